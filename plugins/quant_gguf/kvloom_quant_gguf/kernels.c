/* kvloom-quant-gguf's CPU kernels: GEMMs of int8 activations with GGUF weights.
 *
 * Weights are repacked once at load (kvloom_quant_gguf/layout.py) into one of three
 * formats; each holds, for every tile of 8 output rows ("columns" of the GEMM) and every
 * block of 32 input features, the codes of the tile's weights and float32 parameters, and
 * a weight is  scale * code + min  of its group:
 *
 *   KVQ_U4  4-bit codes 0..15, groups of 32 (Q4_0, Q4_1, Q4_K): 128 bytes per block, byte
 *           p*32 + c*4 + j holds the code of row c, feature 4p+j (low nibble) and 16+4p+j
 *           (high nibble); parameters [8 scales][8 mins].
 *   KVQ_U8  8-bit codes 0..63, groups of 16 (Q5_0, Q5_1, Q5_K, Q6_K, Q2_K, Q3_K): 256 bytes
 *           per block, byte p*32 + c*4 + j the code of row c, feature 4p+j; parameters
 *           [group 0: 8 scales, 8 mins][group 1: 8 scales, 8 mins].
 *   KVQ_S8  signed 8-bit codes, groups of 32, no min (Q8_0): codes as KVQ_U8; [8 scales].
 *
 * Activations are quantized per row and block of 32 features (kvq_quantize) to int8
 * (QMAX 127) or int16 (QMAX 32767): d = max|x| / QMAX, q = round-half-even(x * (1/d)),
 * with, per group of 16, the sum of d * q (for the mins). A GEMM then computes, per group,
 * the integer dot product of codes and q exactly and adds  scale * d * dot + min * sum  in
 * float32. AVX2: int8 activations multiply with vpmaddubsw (at most 2 * 2 * 63 * 127 in a
 * 16-bit lane before vpmaddwd widens it), int16 ones with vpmaddwd (codes widened to 16
 * bits; 32-bit sums of at most 8 * 128 * 32767).
 * kvloom_quant_gguf/kernels.py holds the same arithmetic in torch (the reference).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "kvloom_native.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

enum { KVQ_U4 = 0, KVQ_U8 = 1, KVQ_S8 = 2 };

/* Bytes of codes and float32 parameters per (tile, block) of each format. */
static const int64_t CODE_BYTES[3] = {128, 256, 256};
static const int64_t PARAM_FLOATS[3] = {16, 32, 8};

/* ------------------------------------------------------------------ activations */

/* qx: int8 (bits 8) or int16 (bits 16) [M, K]; dx [M, K / 32]; sx [M, K / 16]. */
void kvq_quantize(int bits, int64_t M, int64_t K, const float *x, int64_t ldx, void *qx, float *dx, float *sx,
                  int nthreads)
{
    const int64_t B = K / 32;
    const float qmax = bits == 8 ? 127.0f : 32767.0f;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        for (int64_t b = 0; b < B; b++) {
            const float *xb = xr + b * 32;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) {
                float a = fabsf(xb[j]);
                amax = a > amax ? a : amax;
            }
            const float d = amax / qmax;
            const float id = d > 0.0f ? 1.0f / d : 0.0f;
            int s0 = 0, s1 = 0;
            for (int j = 0; j < 32; j++) {
                float v = nearbyintf(xb[j] * id);
                v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
                const int q = (int)v;
                if (bits == 8) ((int8_t *)qx)[m * K + b * 32 + j] = (int8_t)q;
                else ((int16_t *)qx)[m * K + b * 32 + j] = (int16_t)q;
                if (j < 16) s0 += q; else s1 += q;
            }
            dx[m * B + b] = d;
            sx[m * 2 * B + 2 * b] = d * (float)s0;
            sx[m * 2 * B + 2 * b + 1] = d * (float)s1;
        }
    }
}

/* ------------------------------------------------------------------ one weight */

/* The float32 weight of row n, feature k (the reference: dequantize and embedding rows). */
static inline float weight_at(int fmt, int64_t B, const uint8_t *wc, const float *wp, int64_t n, int64_t k)
{
    const int64_t t = n / 8, c = n % 8, b = k / 32, kk = k % 32;
    const uint8_t *cb = wc + (t * B + b) * CODE_BYTES[fmt];
    const float *pb = wp + (t * B + b) * PARAM_FLOATS[fmt];
    if (fmt == KVQ_U4) {
        const int half = kk / 16, p = (kk % 16) / 4, j = kk % 4;
        const uint8_t byte = cb[p * 32 + c * 4 + j];
        const float code = (float)(half ? byte >> 4 : byte & 15);
        return pb[c] * code + pb[8 + c];
    }
    const int p = kk / 4, j = kk % 4;
    if (fmt == KVQ_U8) {
        const int g = kk / 16;
        return pb[g * 16 + c] * (float)cb[p * 32 + c * 4 + j] + pb[g * 16 + 8 + c];
    }
    return pb[c] * (float)(int8_t)cb[p * 32 + c * 4 + j];
}

void kvq_rows(int fmt, int64_t count, const int64_t *ids, int64_t K, const uint8_t *wc, const float *wp, float *out,
              int nthreads)
{
    const int64_t B = K / 32;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (count * K >= 65536)
    for (int64_t i = 0; i < count; i++)
        for (int64_t k = 0; k < K; k++)
            out[i * K + k] = weight_at(fmt, B, wc, wp, ids[i], k);
}

/* ------------------------------------------------------------------ tiles */

#define MR 4 /* activation rows per tile pass */

#ifdef __AVX2__
static inline __m256i bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline void store_tile(const __m256 *acc, int mr, float *out, int64_t ldo, int ncols)
{
    for (int r = 0; r < mr; r++) {
        if (ncols == 8) {
            _mm256_storeu_ps(out + r * ldo, acc[r]);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, acc[r]);
            memcpy(out + r * ldo, tmp, sizeof(float) * ncols);
        }
    }
}

/* acc[r] += scale * dx * dot + min * (sum of the block's activations) for one U4 block
   (its 8 rows' scales then mins at wp; sx holds scale * sum per 16 features). */
static inline __attribute__((always_inline)) void add_u4_block(
    __m256 *acc, const int mr, const __m256i *dot, const float *wp, const float *dx, const float *sx, int64_t B,
    int64_t b)
{
    const __m256 sc = _mm256_loadu_ps(wp), mn = _mm256_loadu_ps(wp + 8);
    for (int r = 0; r < mr; r++) {
        const __m256 d = _mm256_mul_ps(sc, _mm256_set1_ps(dx[r * B + b]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), d, acc[r]);
        const float s = sx[r * 2 * B + 2 * b] + sx[r * 2 * B + 2 * b + 1];
        acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(s), acc[r]);
    }
}

static inline __attribute__((always_inline)) void tile_u4(
    const int mr, int64_t B, int64_t K, const int8_t *qx, const float *dx, const float *sx,
    const uint8_t *wc, const float *wp, float *out, int64_t ldo, int ncols)
{
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *cb = wc + b * 128;
        __m256i lo16[MR], hi16[MR];
        for (int r = 0; r < mr; r++) lo16[r] = hi16[r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(cb + p * 32));
            const __m256i lo = _mm256_and_si256(raw, mask);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            for (int r = 0; r < mr; r++) {
                const int8_t *a = qx + r * K + b * 32 + 4 * p;
                lo16[r] = _mm256_add_epi16(lo16[r], _mm256_maddubs_epi16(lo, bcast4(a)));
                hi16[r] = _mm256_add_epi16(hi16[r], _mm256_maddubs_epi16(hi, bcast4(a + 16)));
            }
        }
        __m256i dot[MR];
        for (int r = 0; r < mr; r++)
            dot[r] = _mm256_add_epi32(_mm256_madd_epi16(lo16[r], ones), _mm256_madd_epi16(hi16[r], ones));
        add_u4_block(acc, mr, dot, wp + b * 16, dx, sx, B, b);
    }
    store_tile(acc, mr, out, ldo, ncols);
}

static inline __attribute__((always_inline)) void tile_u8(
    const int mr, int64_t B, int64_t K, const int8_t *qx, const float *dx, const float *sx,
    const uint8_t *wc, const float *wp, float *out, int64_t ldo, int ncols)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        for (int g = 0; g < 2; g++) {
            const uint8_t *cb = wc + b * 256 + g * 128;
            __m256i s01[MR], s23[MR];
            for (int r = 0; r < mr; r++) s01[r] = s23[r] = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(cb + p * 32));
                for (int r = 0; r < mr; r++) {
                    const __m256i prod = _mm256_maddubs_epi16(w, bcast4(qx + r * K + b * 32 + g * 16 + 4 * p));
                    if (p < 2) s01[r] = _mm256_add_epi16(s01[r], prod);
                    else s23[r] = _mm256_add_epi16(s23[r], prod);
                }
            }
            const float *pg = wp + b * 32 + g * 16;
            const __m256 sc = _mm256_loadu_ps(pg), mn = _mm256_loadu_ps(pg + 8);
            for (int r = 0; r < mr; r++) {
                const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(s01[r], ones), _mm256_madd_epi16(s23[r], ones));
                const __m256 d = _mm256_mul_ps(sc, _mm256_set1_ps(dx[r * B + b]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[r]);
                acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sx[r * 2 * B + 2 * b + g]), acc[r]);
            }
        }
    }
    store_tile(acc, mr, out, ldo, ncols);
}

static inline __attribute__((always_inline)) void tile_s8(
    const int mr, int64_t B, int64_t K, const int8_t *qx, const float *dx, const float *sx,
    const uint8_t *wc, const float *wp, float *out, int64_t ldo, int ncols)
{
    (void)sx;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *cb = wc + b * 256;
        __m256i dot[MR];
        for (int r = 0; r < mr; r++) dot[r] = _mm256_setzero_si256();
        for (int p = 0; p < 8; p++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(cb + p * 32));
            const __m256i wabs = _mm256_abs_epi8(w);
            for (int r = 0; r < mr; r++) {
                /* |w| * (a * sign(w)): at most 2 * 128 * 127 per 16-bit lane. */
                const __m256i a = _mm256_sign_epi8(bcast4(qx + r * K + b * 32 + 4 * p), w);
                dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, a), ones));
            }
        }
        const __m256 sc = _mm256_loadu_ps(wp + b * 8);
        for (int r = 0; r < mr; r++) {
            const __m256 d = _mm256_mul_ps(sc, _mm256_set1_ps(dx[r * B + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), d, acc[r]);
        }
    }
    store_tile(acc, mr, out, ldo, ncols);
}

/* int16 activations: 16-bit codes, a 32-bit lane per column and pair of features.
 * unpack{lo,hi}_epi8 give words of columns (0, 1 | 4, 5) and (2, 3 | 6, 7); vpmaddwd with
 * four broadcast activations sums feature pairs; vphaddd of the two sums orders them 0..7. */
static inline __m256i bcast4x16(const int16_t *p)
{
    int64_t v;
    memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
}

static inline __attribute__((always_inline)) void tile16_u4(
    const int mr, int64_t B, int64_t K, const int16_t *qx, const float *dx, const float *sx,
    const uint8_t *wc, const float *wp, float *out, int64_t ldo, int ncols)
{
    const __m256i mask = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    __m256 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *cb = wc + b * 128;
        __m256i s01[MR], s23[MR];
        for (int r = 0; r < mr; r++) s01[r] = s23[r] = zero;
        for (int p = 0; p < 4; p++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(cb + p * 32));
            const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            const __m256i l01 = _mm256_unpacklo_epi8(lo, zero), l23 = _mm256_unpackhi_epi8(lo, zero);
            const __m256i h01 = _mm256_unpacklo_epi8(hi, zero), h23 = _mm256_unpackhi_epi8(hi, zero);
            for (int r = 0; r < mr; r++) {
                const int16_t *a = qx + r * K + b * 32 + 4 * p;
                const __m256i al = bcast4x16(a), ah = bcast4x16(a + 16);
                s01[r] = _mm256_add_epi32(s01[r], _mm256_add_epi32(_mm256_madd_epi16(l01, al), _mm256_madd_epi16(h01, ah)));
                s23[r] = _mm256_add_epi32(s23[r], _mm256_add_epi32(_mm256_madd_epi16(l23, al), _mm256_madd_epi16(h23, ah)));
            }
        }
        __m256i dot[MR];
        for (int r = 0; r < mr; r++) dot[r] = _mm256_hadd_epi32(s01[r], s23[r]);
        add_u4_block(acc, mr, dot, wp + b * 16, dx, sx, B, b);
    }
    store_tile(acc, mr, out, ldo, ncols);
}

/* U8 (unsigned, groups of 16) and S8 (signed, groups of 32) codes with int16 activations. */
static inline __attribute__((always_inline)) void tile16_bytes(
    const int mr, const int fmt, int64_t B, int64_t K, const int16_t *qx, const float *dx, const float *sx,
    const uint8_t *wc, const float *wp, float *out, int64_t ldo, int ncols)
{
    const __m256i zero = _mm256_setzero_si256();
    const int groups = fmt == KVQ_U8 ? 2 : 1, chunks = 8 / groups;
    __m256 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        for (int g = 0; g < groups; g++) {
            __m256i s01[MR], s23[MR];
            for (int r = 0; r < mr; r++) s01[r] = s23[r] = zero;
            for (int p = g * chunks; p < (g + 1) * chunks; p++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wc + b * 256 + p * 32));
                const __m256i ext = fmt == KVQ_S8 ? _mm256_cmpgt_epi8(zero, w) : zero; /* sign or zero bytes */
                const __m256i w01 = _mm256_unpacklo_epi8(w, ext), w23 = _mm256_unpackhi_epi8(w, ext);
                for (int r = 0; r < mr; r++) {
                    const __m256i a = bcast4x16(qx + r * K + b * 32 + 4 * p);
                    s01[r] = _mm256_add_epi32(s01[r], _mm256_madd_epi16(w01, a));
                    s23[r] = _mm256_add_epi32(s23[r], _mm256_madd_epi16(w23, a));
                }
            }
            const float *pg = fmt == KVQ_U8 ? wp + b * 32 + g * 16 : wp + b * 8;
            const __m256 sc = _mm256_loadu_ps(pg);
            for (int r = 0; r < mr; r++) {
                const __m256i dot = _mm256_hadd_epi32(s01[r], s23[r]);
                const __m256 d = _mm256_mul_ps(sc, _mm256_set1_ps(dx[r * B + b]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[r]);
                if (fmt == KVQ_U8)
                    acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(pg + 8), _mm256_set1_ps(sx[r * 2 * B + 2 * b + g]), acc[r]);
            }
        }
    }
    store_tile(acc, mr, out, ldo, ncols);
}

static inline __attribute__((always_inline)) void tile16_u8(
    const int mr, int64_t B, int64_t K, const int16_t *qx, const float *dx, const float *sx,
    const uint8_t *wc, const float *wp, float *out, int64_t ldo, int ncols)
{
    tile16_bytes(mr, KVQ_U8, B, K, qx, dx, sx, wc, wp, out, ldo, ncols);
}

static inline __attribute__((always_inline)) void tile16_s8(
    const int mr, int64_t B, int64_t K, const int16_t *qx, const float *dx, const float *sx,
    const uint8_t *wc, const float *wp, float *out, int64_t ldo, int ncols)
{
    tile16_bytes(mr, KVQ_S8, B, K, qx, dx, sx, wc, wp, out, ldo, ncols);
}

#define DISPATCH(fn, type)                                                                    \
    switch (mr) {                                                                             \
    case 4: fn(4, B, K, (const type *)qx, dx, sx, wc, wp, out, ldo, ncols); break;            \
    case 3: fn(3, B, K, (const type *)qx, dx, sx, wc, wp, out, ldo, ncols); break;            \
    case 2: fn(2, B, K, (const type *)qx, dx, sx, wc, wp, out, ldo, ncols); break;            \
    default: fn(1, B, K, (const type *)qx, dx, sx, wc, wp, out, ldo, ncols); break;           \
    }

static void tile(int fmt, int bits, int mr, int64_t B, int64_t K, const void *qx, const float *dx, const float *sx,
                 const uint8_t *wc, const float *wp, float *out, int64_t ldo, int ncols)
{
    if (bits == 8) {
        if (fmt == KVQ_U4) { DISPATCH(tile_u4, int8_t) }
        else if (fmt == KVQ_U8) { DISPATCH(tile_u8, int8_t) }
        else { DISPATCH(tile_s8, int8_t) }
    } else {
        if (fmt == KVQ_U4) { DISPATCH(tile16_u4, int16_t) }
        else if (fmt == KVQ_U8) { DISPATCH(tile16_u8, int16_t) }
        else { DISPATCH(tile16_s8, int16_t) }
    }
}

#else /* portable C: the same integer dot products, one row at a time */

static void tile(int fmt, int bits, int mr, int64_t B, int64_t K, const void *qx, const float *dx, const float *sx,
                 const uint8_t *wc, const float *wp, float *out, int64_t ldo, int ncols)
{
    const int G = fmt == KVQ_U8 ? 16 : 32;
    for (int r = 0; r < mr; r++) {
        for (int c = 0; c < ncols; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < B; b++) {
                const uint8_t *cb = wc + b * CODE_BYTES[fmt];
                const float *pb = wp + b * PARAM_FLOATS[fmt];
                for (int g = 0; g < 32 / G; g++) {
                    int32_t dot = 0;
                    for (int kk = g * G; kk < (g + 1) * G; kk++) {
                        const int64_t at = r * K + b * 32 + kk;
                        const int a = bits == 8 ? ((const int8_t *)qx)[at] : ((const int16_t *)qx)[at];
                        int code;
                        if (fmt == KVQ_U4) {
                            const uint8_t byte = cb[((kk % 16) / 4) * 32 + c * 4 + kk % 4];
                            code = kk < 16 ? byte & 15 : byte >> 4;
                        } else if (fmt == KVQ_U8) {
                            code = cb[(kk / 4) * 32 + c * 4 + kk % 4];
                        } else {
                            code = (int8_t)cb[(kk / 4) * 32 + c * 4 + kk % 4];
                        }
                        dot += code * a;
                    }
                    const float d = dx[r * B + b];
                    if (fmt == KVQ_U4) {
                        acc += (float)dot * (pb[c] * d) + pb[8 + c] * (sx[r * 2 * B + 2 * b] + sx[r * 2 * B + 2 * b + 1]);
                    } else if (fmt == KVQ_U8) {
                        acc += (float)dot * (pb[g * 16 + c] * d) + pb[g * 16 + 8 + c] * sx[r * 2 * B + 2 * b + g];
                    } else {
                        acc += (float)dot * (pb[c] * d);
                    }
                }
            }
            out[r * ldo + c] = acc;
        }
    }
}
#endif

/* ------------------------------------------------------------------ GEMM */

#define ROW_CHUNK 32 /* activation rows one work item covers */
#define PARALLEL_MIN_MACS (1 << 17)
#define MAX_SEGMENTS 8

/* One linear layer: out[m, n] (row stride ldo) = sum_k x[m, k] * w[n, k] for the weight rows
 * of `nseg` segments: segment s is rows[s] rows in format fmts[s] (codes[s], params[s]),
 * written to the output columns from starts[s]. x [M, K] (row stride ldx) is quantized to
 * `bits` once (kvq_quantize), then every (segment, tile of 8 rows, chunk of activation rows)
 * is a work item of one parallel loop. Returns 0, or -1 when nseg is out of range or the
 * activations' buffer cannot be allocated. */
int kvq_linear(int bits, int64_t M, int64_t K, const float *x, int64_t ldx, int nseg, const int *fmts,
               const int64_t *starts, const int64_t *rows, const uint8_t *const *codes, const float *const *params,
               float *out, int64_t ldo, int nthreads)
{
    const int64_t B = K / 32, qbytes = bits / 8, chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
    if (nseg < 1 || nseg > MAX_SEGMENTS) return -1;
    uint8_t *qx = (uint8_t *)thread_scratch(M * K * qbytes + M * B * 12); /* the activations, quantized */
    if (qx == NULL) return -1;
    float *dx = (float *)(qx + M * K * qbytes), *sx = dx + M * B;
    kvq_quantize(bits, M, K, x, ldx, qx, dx, sx, nthreads);

    int64_t first_tile[MAX_SEGMENTS + 1], N = 0;
    first_tile[0] = 0;
    for (int s = 0; s < nseg; s++) {
        N += rows[s];
        first_tile[s + 1] = first_tile[s] + (rows[s] + 7) / 8;
    }
    const int64_t T = first_tile[nseg];
    /* Threads cost a few microseconds to wake: small products run on the calling one. */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * N * K >= PARALLEL_MIN_MACS)
    for (int64_t item = 0; item < chunks * T; item++) {
        const int64_t tile_index = item % T, m0 = (item / T) * ROW_CHUNK;
        int s = 0;
        while (tile_index >= first_tile[s + 1]) s++;
        const int fmt = fmts[s];
        const int64_t t = tile_index - first_tile[s];
        const int64_t m1 = m0 + ROW_CHUNK < M ? m0 + ROW_CHUNK : M;
        const int ncols = rows[s] - t * 8 < 8 ? (int)(rows[s] - t * 8) : 8;
        const uint8_t *wc = codes[s] + t * CODE_BYTES[fmt] * B;
        const float *wp = params[s] + t * PARAM_FLOATS[fmt] * B;
        for (int64_t m = m0; m < m1; m += MR) {
            const int mr = m1 - m < MR ? (int)(m1 - m) : MR;
            tile(fmt, bits, mr, B, K, (const char *)qx + m * K * qbytes, dx + m * B, sx + m * 2 * B, wc, wp,
                 out + m * ldo + starts[s] + t * 8, ldo, ncols);
        }
    }
    return 0;
}
