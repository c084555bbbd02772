/* CPU_ATTN's decode attention: one query token per request over a paged float32 KV cache.
 *
 * Work item = (request, KV head): its G = num_heads / num_kv_heads query heads read each
 * of the request's key and value rows once, straight from the cache blocks (no gather, no
 * padding), in float32: per query head the scores, their max m, e = exp(score - m) and
 * l = sum(e), then out = sum(e * v) / l.
 *
 * Positions key_start[r] .. seq_len[r] - 1 are attended (key_start > 0 under a sliding
 * window); block_table[r, c] holds positions first_pos[r] + c * block_size onwards.
 * kvloom_backend_cpu/impl.py calls it for float32 layers without soft cap or sinks; the
 * float64 reference in kvloom.testing checks it (backends/cpu/tests).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "kvloom_native.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MAX_GROUP 64 /* query heads per KV head */
#define MAX_HEAD 256 /* head size */

static inline float dot(const float *a, const float *b, int64_t n)
{
    int64_t i = 0;
    float s = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    s = _mm_cvtss_f32(h);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#ifdef __AVX2__
/* The sums of a[0..7]'s lanes, in order. */
static inline __m256 sum8(const __m256 *a)
{
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* out[0..7] = q . k_j for the eight rows k + j * stride (n a multiple of 8). */
static inline void dot8(const float *q, const float *k, int64_t stride, int64_t n, float scale, float *out)
{
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * stride + i), acc[j]);
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
}

/* exp(x) of eight floats (x <= 0 here: scores minus their max), Cody-Waite reduction to
 * x = n ln2 + r, |r| <= ln2 / 2, and a degree-6 polynomial for exp(r); about 1 ulp. */
static inline __m256 exp8(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f)); /* exp(-87) ~ 1.6e-38: still a normal float */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

/* scores[i] = exp(scores[i] - m) for i < n; returns their sum. */
static inline float exp_shifted(float *scores, int64_t n, float m)
{
    int64_t i = 0;
    float l = 0.0f;
#ifdef __AVX2__
    __m256 sum = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), mv));
        _mm256_storeu_ps(scores + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    for (int j = 0; j < 8; j++) l += lanes[j];
#endif
    for (; i < n; i++) {
        scores[i] = expf(scores[i] - m);
        l += scores[i];
    }
    return l;
}

/* acc += p * v */
static inline void axpy(float *acc, float p, const float *v, int64_t n)
{
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 vp = _mm256_set1_ps(p);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(vp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
#endif
    for (; i < n; i++) acc[i] += p * v[i];
}

/* One (request, KV head): the G query heads at qh over positions key_start .. seq_len - 1.
 * Each key row is read once for all G heads' scores, then per head e = exp(score - max)
 * and l = sum(e), then each value row once for all G heads' sums of e * v; out = sum / l.
 * Returns 0, or -1 without memory for the scores. */
static int attend(int64_t group, int64_t head_size, float scale, const float *qh, float *oh, const float *key_cache,
                  const float *value_cache, int64_t block_stride, int64_t pos_stride, int64_t block_size,
                  const int64_t *table, int64_t first_pos, int64_t key_start, int64_t seq_len)
{
    const int64_t n = seq_len - key_start;
    float *scores = (float *)thread_scratch(group * (n > 0 ? n : 1) * (int64_t)sizeof(float)); /* [group][n] */
    if (scores == NULL) return -1;
    /* Block by block (no division per position): column c holds positions first_pos + c * block_size on. */
    const int64_t first_col = (key_start - first_pos) / block_size;
    const int64_t end_col = (seq_len - first_pos + block_size - 1) / block_size;
    for (int64_t c = first_col, i = 0; c < end_col; c++) {
        const int64_t base = first_pos + c * block_size;
        const int64_t p0 = base > key_start ? base : key_start;
        const int64_t p1 = base + block_size < seq_len ? base + block_size : seq_len;
        const float *k = key_cache + table[c] * block_stride + (p0 - base) * pos_stride;
        int64_t p = p0;
#ifdef __AVX2__
        if (head_size % 8 == 0)
            for (; p + 8 <= p1; p += 8, i += 8, k += 8 * pos_stride)
                for (int64_t g = 0; g < group; g++) dot8(qh + g * head_size, k, pos_stride, head_size, scale, scores + g * n + i);
#endif
        for (; p < p1; p++, i++, k += pos_stride)
            for (int64_t g = 0; g < group; g++) scores[g * n + i] = dot(qh + g * head_size, k, head_size) * scale;
    }
    float l[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * n, m = -INFINITY;
        for (int64_t i = 0; i < n; i++) m = sg[i] > m ? sg[i] : m;
        l[g] = exp_shifted(sg, n, m);
    }
    for (int64_t d = 0; d < group * head_size; d++) oh[d] = 0.0f;
    for (int64_t c = first_col, i = 0; c < end_col; c++) {
        const int64_t base = first_pos + c * block_size;
        const int64_t p0 = base > key_start ? base : key_start;
        const int64_t p1 = base + block_size < seq_len ? base + block_size : seq_len;
        const float *v = value_cache + table[c] * block_stride + (p0 - base) * pos_stride;
        for (int64_t p = p0; p < p1; p++, i++, v += pos_stride)
            for (int64_t g = 0; g < group; g++) axpy(oh + g * head_size, scores[g * n + i], v, head_size);
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int64_t d = 0; d < head_size; d++) oh[g * head_size + d] *= inv;
    }
    return 0;
}

/* A layer (built once per layer and cache): heads, scale, the K and V caches and their
 * strides in floats (a block, a position, a KV head; the head size's own stride is 1). */
typedef struct {
    int64_t num_heads, num_kv_heads, head_size;
    float scale;
    const float *key_cache, *value_cache;
    int64_t block_stride, pos_stride, head_stride, block_size;
} layer_args;

/* A step's decode requests (built once per step, read by every layer): query/output row of
 * request r = rows ? rows[r] : first_row + r; block_table [num_reqs, width] from position first_pos[r]
 * on; positions key_start[r] .. seq_len[r] - 1 attended. */
typedef struct {
    int64_t num_reqs, first_row;
    const int64_t *rows, *block_table;
    int64_t width;
    const int64_t *first_pos, *key_start, *seq_len;
} batch_args;

/* q, out: token rows of num_heads * head_size floats (row strides q_stride, out_stride).
 * Returns 0, or -1 for heads it does not take or without memory for the scores. */
int cpu_decode_attention(const layer_args *layer, const batch_args *batch, const float *q, int64_t q_stride, float *out,
                         int64_t out_stride, int nthreads)
{
    const int64_t kv_heads = layer->num_kv_heads, head_size = layer->head_size;
    const int64_t group = layer->num_heads / kv_heads, items = batch->num_reqs * kv_heads;
    if (group < 1 || group > MAX_GROUP || head_size > MAX_HEAD || layer->num_heads % kv_heads) return -1;
    int64_t work = 0;
    for (int64_t r = 0; r < batch->num_reqs; r++) work += (batch->seq_len[r] - batch->key_start[r]) * kv_heads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (items > 1 && work * head_size * group >= 65536) reduction(| : failed)
    for (int64_t item = 0; item < items; item++) {
        const int64_t r = item / kv_heads, h = item % kv_heads, row = batch->rows ? batch->rows[r] : batch->first_row + r;
        failed |= attend(group, head_size, layer->scale, q + row * q_stride + h * group * head_size,
                         out + row * out_stride + h * group * head_size, layer->key_cache + h * layer->head_stride,
                         layer->value_cache + h * layer->head_stride, layer->block_stride, layer->pos_stride,
                         layer->block_size, batch->block_table + r * batch->width, batch->first_pos[r],
                         batch->key_start[r], batch->seq_len[r]);
    }
    return failed ? -1 : 0;
}

/* The KV write: key/value row i (kv_heads * head_size floats, row strides key_stride,
 * value_stride) to cache slot slots[i] (slot = block * block_size + position in block). */
void cpu_write_kv(const layer_args *layer, int64_t count, const int64_t *slots, const float *key, int64_t key_stride,
                  const float *value, int64_t value_stride)
{
    const int64_t kv_heads = layer->num_kv_heads, size = layer->head_size;
    for (int64_t i = 0; i < count; i++) {
        const int64_t block = slots[i] / layer->block_size, offset = slots[i] % layer->block_size;
        const int64_t at = block * layer->block_stride + offset * layer->pos_stride;
        float *kc = (float *)layer->key_cache + at, *vc = (float *)layer->value_cache + at;
        for (int64_t h = 0; h < kv_heads; h++) {
            memcpy(kc + h * layer->head_stride, key + i * key_stride + h * size, (size_t)size * sizeof(float));
            memcpy(vc + h * layer->head_stride, value + i * value_stride + h * size, (size_t)size * sizeof(float));
        }
    }
}
