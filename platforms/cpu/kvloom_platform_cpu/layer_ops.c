/* The CPU platform's layer ops (kvloom.layers.custom_ops) for float32 models: fewer calls
 * than the chains of small torch ops they replace (a decode step of a small model is mostly
 * their per-op overhead), with the torch code's results bit for bit (float32 parity with
 * HF transformers is exact on the CPU):
 *
 *   cpu_rms_norm_scale  the norm after torch's own mean(x^2): w * (x * (1 / sqrt(var + eps)))
 *   cpu_rotary          HF's rotate-half: [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
 *
 * Each step rounds as torch's does (-ffp-contract=off: no fused multiply-adds; 1 / sqrt is
 * torch's rsqrt). kvloom_platform_cpu/layer_ops.py calls them; kvloom.testing.check_custom_op
 * holds them to the contract (platforms/cpu/tests).
 */
#include <stdint.h>
#include <math.h>

/* out = w * (x * (1 / sqrt(variance + eps))) per row, variance = sum_sq / N: the rest of the
 * torch code after its sum of the squares (summed by torch itself, whose summation order a C
 * loop would not repeat; torch's mean is that sum divided by N, in float32), rounded as
 * torch rounds each step. x [M, N] (row stride ldx), sum_sq [M], out contiguous. */
void cpu_rms_norm_scale(int64_t M, int64_t N, const float *x, int64_t ldx, const float *sum_sq, const float *w,
                        float eps, float *out, int nthreads)
{
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * N >= 262144)
    for (int64_t m = 0; m < M; m++) {
        const float r = 1.0f / sqrtf(sum_sq[m] / (float)N + eps);
        const float *xr = x + m * ldx;
        float *o = out + m * N;
        for (int64_t j = 0; j < N; j++) o[j] = w[j] * (xr[j] * r);
    }
}

/* x [T, H, D] (strides xt, xh; D contiguous), cos/sin [T, D/2] (row stride lcs), out
 * [T, H, D] contiguous. */
void cpu_rotary(int64_t T, int64_t H, int64_t D, const float *x, int64_t xt, int64_t xh, const float *cos_,
                const float *sin_, int64_t lcs, float *out, int nthreads)
{
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * H * D >= 262144)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * lcs, *s = sin_ + t * lcs;
        for (int64_t h = 0; h < H; h++) {
            const float *x1 = x + t * xt + h * xh, *x2 = x1 + half;
            float *o = out + (t * H + h) * D;
            for (int64_t j = 0; j < half; j++) {
                const float a = x1[j] * c[j], b = x2[j] * s[j], e = x2[j] * c[j], f = x1[j] * s[j];
                o[j] = a - b;
                o[half + j] = e + f;
            }
        }
    }
}
