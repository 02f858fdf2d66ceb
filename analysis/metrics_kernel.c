/* The full-vocabulary reductions of analysis/metrics.py, one row pair at a time, in float64.

   Built on first use by analysis/metrics_native.py and called through ctypes, which releases
   the GIL: rows run on several threads. -ffp-contract=off: no fused multiply-adds, so swapping
   the two rows swaps KL's directions and leaves JS as it is, to the bit. The arithmetic is the
   reference implementation's (metrics.py _reduce_numpy), term for term; only the summation
   order and exp/log (glibc's vector math library, libmvec, <= 4 ulp) differ, so the two agree
   to ~1e-15 relative.

   Three passes over a row, each vectorised (the row pair stays in cache between them):
     1. block maxima (for top-k), row maxima, and the raw-logit sums (dot, norms, diff, max |diff|)
     2. the two softmax denominators
     3. KL both ways, JS, both entropies                                                     */

#include <math.h>
#include <stdint.h>

/* The vector variants glibc declares only under -ffast-math, which would also let the
   compiler drop the IEEE behaviour of inf and NaN that a masked or broken row relies on. */
#ifndef NO_LIBMVEC
double exp(double) __attribute__((simd("notinbranch")));
double log(double) __attribute__((simd("notinbranch")));
#endif

enum { KLD, KLDR, JS, H_REF, H_STK, RS, RR, SS, DSQ, MAD, LSE_REF, LSE_STK, OUTS };

#define ROW_KERNEL(NAME, T)                                                                      \
static void NAME##_row(const T *x, const T *y, int64_t vocab, int64_t block, double *out,         \
                       T *bmax_x, T *bmax_y) {                                                   \
    int64_t nb = vocab / block;                                                                  \
    double mr = -INFINITY, ms = -INFINITY, rs = 0, rr = 0, ss = 0, dsq = 0, mad = 0;             \
    for (int64_t b = 0; b < nb; b++) {                                                           \
        T bx = x[b * block], by = y[b * block];                                                  \
        _Pragma("omp simd reduction(max:bx, by)")                                                \
        for (int64_t i = b * block; i < (b + 1) * block; i++) {                                  \
            bx = x[i] > bx ? x[i] : bx;                                                          \
            by = y[i] > by ? y[i] : by;                                                          \
        }                                                                                        \
        bmax_x[b] = bx, bmax_y[b] = by;                                                          \
        mr = bx > mr ? bx : mr, ms = by > ms ? by : ms;                                          \
    }                                                                                            \
    for (int64_t i = nb * block; i < vocab; i++)                                                 \
        mr = x[i] > mr ? x[i] : mr, ms = y[i] > ms ? y[i] : ms;                                  \
    _Pragma("omp simd reduction(+:rs, rr, ss, dsq) reduction(max:mad)")                          \
    for (int64_t i = 0; i < vocab; i++) {                                                        \
        double r = x[i], s = y[i], d = s - r, a = fabs(d);                                        \
        rs += r * s, rr += r * r, ss += s * s, dsq += d * d;                                     \
        mad = a > mad ? a : mad;                                                                 \
    }                                                                                            \
    double sr = 0, sq = 0;                                                                       \
    _Pragma("omp simd reduction(+:sr, sq)")                                                      \
    for (int64_t i = 0; i < vocab; i++)                                                          \
        sr += exp((double)x[i] - mr), sq += exp((double)y[i] - ms);                              \
    double lser = mr + log(sr), lses = ms + log(sq);                                             \
    double kld = 0, kldr = 0, js = 0, hr = 0, hs = 0;                                            \
    _Pragma("omp simd reduction(+:kld, kldr, js, hr, hs)")                                       \
    for (int64_t i = 0; i < vocab; i++) {                                                        \
        double lp = (double)x[i] - lser, lq = (double)y[i] - lses;                               \
        double p = exp(lp), q = exp(lq), d = lq - lp, m = 0.5 * (p + q);                         \
        double lm = log(m), pl = p * lp, ql = q * lq;                                            \
        kld += q - p - p * d;                                                                    \
        kldr += p - q + q * d;                                                                   \
        js += 0.5 * (pl + ql) - (m > 0 ? m * lm : 0.0);                                          \
        hr -= pl, hs -= ql;                                                                      \
    }                                                                                            \
    out[KLD] = kld, out[KLDR] = kldr, out[JS] = js, out[H_REF] = hr, out[H_STK] = hs;             \
    out[RS] = rs, out[RR] = rr, out[SS] = ss, out[DSQ] = dsq, out[MAD] = mad;                     \
    out[LSE_REF] = lser, out[LSE_STK] = lses;                                                    \
}                                                                                                \
                                                                                                 \
/* rows [first, last) of (rows, vocab) x and y -> out (rows, OUTS), block maxima (rows, nb) */    \
void NAME(const T *x, const T *y, int64_t first, int64_t last, int64_t vocab, int64_t block,      \
          double *out, T *bmax_x, T *bmax_y) {                                                   \
    int64_t nb = vocab / block;                                                                  \
    for (int64_t r = first; r < last; r++)                                                       \
        NAME##_row(x + r * vocab, y + r * vocab, vocab, block, out + r * OUTS,                   \
                   bmax_x + r * nb, bmax_y + r * nb);                                            \
}

ROW_KERNEL(reduce_f32, float)
ROW_KERNEL(reduce_f64, double)

int64_t outputs(void) { return OUTS; }
