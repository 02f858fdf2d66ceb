/* The full-vocabulary reductions of analysis/metrics.py, one row pair at a time, in float64.

   Built on first use by analysis/metrics_native.py and called through ctypes, which releases
   the GIL: rows run on several threads. -ffp-contract=off: no fused multiply-adds, so swapping
   the two rows swaps KL's directions and leaves JS as it is, to the bit. The arithmetic is the
   reference implementation's (metrics.py _reduce_numpy), term for term; only the summation
   order and exp/log (glibc's vector math library, libmvec, <= 4 ulp) differ, so the two agree
   to ~1e-15 relative.

   Rows come as float32, float64, or bf16 bits with the row's shift (how `store: bf16` keeps them:
   value = bf16 + shift, added in float32 as store/values.py unshift adds it), so stored rows are
   measured as they are, without a widened copy of either side. The values are the same either
   way; the sums may round in another order (the vectoriser's choice): KL and JS agree to ~1e-11 relative, the rest closer.

   Three passes over a row pair, each vectorised:
     1. block maxima (for top-k), row maxima, and the raw-logit sums (dot, norms, diff, max |diff|)
     2. the two softmax denominators, each e^(x - max) kept in the call's buffer (2 x vocab doubles)
     3. KL both ways, JS, both entropies, with p and q from that buffer: one log an element where
        a second softmax would take two exps and a log (docs/benchmark-notes.md) */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The vector variants glibc declares only under -ffast-math, which would also let the
   compiler drop the IEEE behaviour of inf and NaN that a masked or broken row relies on. */
#ifndef NO_LIBMVEC
double exp(double) __attribute__((simd("notinbranch")));
double log(double) __attribute__((simd("notinbranch")));
#endif

enum { KLD, KLDR, JS, H_REF, H_STK, RS, RR, SS, DSQ, MAD, LSE_REF, LSE_STK, OUTS };

static inline float bf16_at(const uint16_t *p, int64_t i, float shift) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f + shift;
}
#define PLAIN_AT(p, i, shift) ((p)[i])
#define BF16_AT(p, i, shift) bf16_at(p, i, shift)

/* NAME##_row: one row pair of element type T, read as values of type V by AT(row, i, shift) */
#define ROW_KERNEL(NAME, T, V, AT)                                                               \
static void NAME##_row(const T *x, const T *y, V sx, V sy, int64_t vocab, int64_t block,         \
                       double *out, V *bmax_x, V *bmax_y, double *ex) {                          \
    int64_t nb = vocab / block;                                                                  \
    double mr = -INFINITY, ms = -INFINITY, rs = 0, rr = 0, ss = 0, dsq = 0, mad = 0;             \
    for (int64_t b = 0; b < nb; b++) {                                                           \
        V bx = AT(x, b * block, sx), by = AT(y, b * block, sy);                                  \
        _Pragma("omp simd reduction(max:bx, by)")                                                \
        for (int64_t i = b * block; i < (b + 1) * block; i++) {                                  \
            V xi = AT(x, i, sx), yi = AT(y, i, sy);                                              \
            bx = xi > bx ? xi : bx;                                                              \
            by = yi > by ? yi : by;                                                              \
        }                                                                                        \
        bmax_x[b] = bx, bmax_y[b] = by;                                                          \
        mr = bx > mr ? bx : mr, ms = by > ms ? by : ms;                                          \
    }                                                                                            \
    for (int64_t i = nb * block; i < vocab; i++) {                                               \
        V xi = AT(x, i, sx), yi = AT(y, i, sy);                                                  \
        mr = xi > mr ? xi : mr, ms = yi > ms ? yi : ms;                                          \
    }                                                                                            \
    _Pragma("omp simd reduction(+:rs, rr, ss, dsq) reduction(max:mad)")                              \
    for (int64_t i = 0; i < vocab; i++) {                                                        \
        double r = AT(x, i, sx), s = AT(y, i, sy), d = s - r, a = fabs(d);                        \
        rs += r * s, rr += r * r, ss += s * s, dsq += d * d;                                     \
        mad = a > mad ? a : mad;                                                                 \
    }                                                                                            \
    double *ey = ex + vocab, sr = 0, sq = 0;                                                     \
    _Pragma("omp simd reduction(+:sr, sq)")                                                          \
    for (int64_t i = 0; i < vocab; i++) {                                                        \
        ex[i] = exp((double)AT(x, i, sx) - mr), ey[i] = exp((double)AT(y, i, sy) - ms);          \
        sr += ex[i], sq += ey[i];                                                                \
    }                                                                                            \
    double lser = mr + log(sr), lses = ms + log(sq), ir = 1.0 / sr, is = 1.0 / sq;               \
    double kld = 0, kldr = 0, js = 0, hr = 0, hs = 0;                                            \
    _Pragma("omp simd reduction(+:kld, kldr, js, hr, hs)")                                           \
    for (int64_t i = 0; i < vocab; i++) {                                                        \
        double lp = (double)AT(x, i, sx) - lser, lq = (double)AT(y, i, sy) - lses;               \
        double p = ex[i] * ir, q = ey[i] * is, d = lq - lp, m = 0.5 * (p + q);                   \
        double lm = log(m), pl = p * lp, ql = q * lq;                                            \
        kld += q - p - p * d;                                                                    \
        kldr += p - q + q * d;                                                                   \
        js += 0.5 * (pl + ql) - (m > 0 ? m * lm : 0.0);                                          \
        hr -= pl, hs -= ql;                                                                      \
    }                                                                                            \
    out[KLD] = kld, out[KLDR] = kldr, out[JS] = js, out[H_REF] = hr, out[H_STK] = hs;             \
    out[RS] = rs, out[RR] = rr, out[SS] = ss, out[DSQ] = dsq, out[MAD] = mad;                     \
    out[LSE_REF] = lser, out[LSE_STK] = lses;                                                    \
}

ROW_KERNEL(plain_f32, float, float, PLAIN_AT)
ROW_KERNEL(plain_f64, double, double, PLAIN_AT)
ROW_KERNEL(stored_bf16, uint16_t, float, BF16_AT)

/* rows [first, last) of (rows, vocab) x and y -> out (rows, OUTS), block maxima (rows, nb).
   Each returns 0, or -1 where the call's exps buffer could not be had (out of memory). */
#define ROWS_PLAIN(NAME, T, ROW)                                                                 \
int64_t NAME(const T *x, const T *y, int64_t first, int64_t last, int64_t vocab, int64_t block,   \
             double *out, T *bmax_x, T *bmax_y) {                                                \
    int64_t nb = vocab / block;                                                                  \
    double *ex = malloc(2 * (size_t)(vocab > 0 ? vocab : 1) * sizeof(double));                   \
    if (!ex)                                                                                     \
        return -1;                                                                               \
    for (int64_t r = first; r < last; r++)                                                       \
        ROW(x + r * vocab, y + r * vocab, 0, 0, vocab, block, out + r * OUTS, bmax_x + r * nb,   \
            bmax_y + r * nb, ex);                                                                \
    free(ex);                                                                                    \
    return 0;                                                                                    \
}

ROWS_PLAIN(reduce_f32, float, plain_f32_row)
ROWS_PLAIN(reduce_f64, double, plain_f64_row)

/* The same over bf16 bits (rows, vocab) and each row's shift (rows,) on both sides. */
int64_t reduce_bf16(const uint16_t *x, const float *sx, const uint16_t *y, const float *sy, int64_t first,
                    int64_t last, int64_t vocab, int64_t block, double *out, float *bmax_x, float *bmax_y) {
    int64_t nb = vocab / block;
    double *ex = malloc(2 * (size_t)(vocab > 0 ? vocab : 1) * sizeof(double));
    if (!ex)
        return -1;
    for (int64_t r = first; r < last; r++)
        stored_bf16_row(x + r * vocab, y + r * vocab, sx[r], sy[r], vocab, block, out + r * OUTS, bmax_x + r * nb,
                        bmax_y + r * nb, ex);
    free(ex);
    return 0;
}

int64_t outputs(void) { return OUTS; }
