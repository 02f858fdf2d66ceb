/* store/floors.py's fused pass in C: each row shifted by its max, rounded to bf16 (round to
   nearest even, as store/values.py to_bf16), and its storage floor KL(P_row || P_stored) measured
   in the same pass. Built and loaded by common/native.py.

   With z = row - max <= 0, s its bf16 rounding and d = s - z (exact in float32),
   KL = log1p(b + c) - b, b = sum p d, c = sum p (e^d - 1 - d), e^d - 1 - d = d^2 (1/2 + d/6 + d^2/24):
   the arithmetic of floors.py _fused_keep, with its sums in float64. A row that is not finite
   (a NaN, an infinite max, a masked -inf token) gets floor NaN: the caller redoes it the general way. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef NO_LIBMVEC
float expf(float) __attribute__((simd("notinbranch")));  /* libmvec's, as in metrics_kernel.c */
#endif

static void keep_row(const float *x, int64_t vocab, uint16_t *out, float *shift, double *floor_) {
    float m = -INFINITY;
#pragma omp simd reduction(max:m)
    for (int64_t i = 0; i < vocab; i++)
        m = x[i] > m ? x[i] : m;
    if (!isfinite(m)) {
        *shift = 0.0f, *floor_ = NAN;
        return;
    }
    double total = 0, b = 0, c = 0;
#pragma omp simd reduction(+:total, b, c)
    for (int64_t i = 0; i < vocab; i++) {
        float z = x[i] - m, s, d, e, cc;
        uint32_t bits, u;
        memcpy(&bits, &z, 4);
        u = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        out[i] = (uint16_t)u;
        u <<= 16;
        memcpy(&s, &u, 4);
        d = s - z;
        e = expf(z);
        cc = ((d * (1.0f / 24) + (1.0f / 6)) * d + 0.5f) * d * d;
        total += e, b += (double)e * d, c += (double)e * cc;
    }
    b /= total, c /= total;
    *shift = m;
    *floor_ = c - ((b + c) - log1p(b + c));  /* log1p(b + c) - b without its cancellation */
}

/* rows [first, last) of (rows, vocab) float32 x -> stored (rows, vocab) bf16 bits, shift (rows,), floor (rows,) */
void keep_bf16(const float *x, int64_t first, int64_t last, int64_t vocab, uint16_t *stored, float *shift,
               double *floor_) {
    for (int64_t r = first; r < last; r++)
        keep_row(x + r * vocab, vocab, stored + r * vocab, shift + r, floor_ + r);
}
