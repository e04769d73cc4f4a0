/* A layer's per-row work on the CPU, compiled: RMSNorm, the residual add fused with it, and the rotary embedding of
   a step's queries and keys with the write of its keys and values into the paged cache.

   Each row is computed alone, in an order fixed by its width: a row's bits never depend on the other rows or how
   many threads run. RMSNorm sums a row's squares with element d in lane d % LANES, each lane in element order, the
   lanes added in a fixed tree; mean = sum / width; the row is scaled by 1 / sqrtf(mean + eps) (both correctly
   rounded), rounded to the dtype, then multiplied by the weight and rounded again, as the model's norm is written.
   The residual add and the rotation are the torch ops they replace, to the bit: each product, sum and difference is
   one rounded float operation (built with -ffp-contract=off, never -ffast-math), and a float goes to bfloat16 by
   rounding to nearest, ties to even, as torch rounds it.

   Dtypes: 0 float32, 1 bfloat16. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
/* Rows below this many go on one thread: a parallel region costs more than their work. */
#define PARALLEL_ROWS 64

enum dtype { F32 = 0, BF16 = 1 };

static inline float load(const void *base, int dtype, int64_t i) {
    if (dtype == BF16) {
        union { uint32_t u; float f; } v;
        v.u = (uint32_t)((const uint16_t *)base)[i] << 16;
        return v.f;
    }
    return ((const float *)base)[i];
}

/* Round x to the dtype and store it. */
static inline void store(void *base, int dtype, int64_t i, float x) {
    if (dtype == BF16) {
        union { float f; uint32_t u; } v = {x};
        ((uint16_t *)base)[i] = x != x ? 0x7fc0 : (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
    } else {
        ((float *)base)[i] = x;
    }
}

/* x rounded to the dtype, as a float. */
static inline float rounded(int dtype, float x) {
    if (dtype == F32) return x;
    uint16_t h;
    store(&h, BF16, 0, x);
    return load(&h, BF16, 0);
}

/* One row: out = weight * round(x * 1 / sqrt(mean(x^2) + eps)), x read as floats from `row`. */
static void norm_row(const float *row, int64_t width, const void *weight, float eps, int dtype, void *out,
                     int64_t at) {
    float lane[LANES] = {0};
    int64_t d0 = 0;
    for (; d0 + LANES <= width; d0 += LANES)
        for (int i = 0; i < LANES; i++) lane[i] += row[d0 + i] * row[d0 + i];
    for (int i = 0; d0 + i < width; i++) lane[i] += row[d0 + i] * row[d0 + i];
    for (int span = LANES / 2; span > 0; span /= 2)
        for (int i = 0; i < span; i++) lane[i] += lane[i + span];
    const float scale = 1.0f / sqrtf(lane[0] / (float)width + eps);
    for (int64_t d = 0; d < width; d++)
        store(out, dtype, at + d, load(weight, dtype, d) * rounded(dtype, row[d] * scale));
}

/* out[r] = rms_norm(x[r]) for rows x [rows, width], all in one dtype. */
void stackpin_rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t width, float eps,
                       int dtype, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float row[width];
        for (int64_t d = 0; d < width; d++) row[d] = load(x, dtype, r * width + d);
        norm_row(row, width, weight, eps, dtype, out, r * width);
    }
}

/* summed[r] = round(x[r] + delta[r]); normed[r] = rms_norm(summed[r]). */
void stackpin_add_rms_norm(const void *x, const void *delta, const void *weight, void *summed, void *normed,
                           int64_t rows, int64_t width, float eps, int dtype, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float row[width];
        for (int64_t d = 0; d < width; d++) {
            const int64_t at = r * width + d;
            row[d] = rounded(dtype, load(x, dtype, at) + load(delta, dtype, at));
            store(summed, dtype, at, row[d]);
        }
        norm_row(row, width, weight, eps, dtype, normed, r * width);
    }
}

/* A step's qkv rows [T, (Hq + 2 Hkv) * D]: the queries and keys rotated by their position's row of the tables
   cos, sin [positions, D / 2] (float32; halves rotated as Hugging Face's rotate_half does, each result rounded to the
   dtype), the queries written to q_out [T, Hq, D], the keys and values to the caches' rows `slots`
   ([blocks * block_size, Hkv, D], the cache in the same dtype). Returns 0, or -2 (and writes nothing) when a position
   is not a row of the tables or a slot not a row of the caches. */
int stackpin_rope_cache(const void *qkv, int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                        const float *cos, const float *sin, int64_t table_rows, const int64_t *positions,
                        const int64_t *slots, int64_t cache_rows, void *q_out, void *k_cache, void *v_cache,
                        int dtype, int threads) {
    const int64_t half = head_dim / 2, width = (q_heads + 2 * kv_heads) * head_dim;
    for (int64_t t = 0; t < tokens; t++) /* nothing is written unless every index fits */
        if (positions[t] < 0 || positions[t] >= table_rows || slots[t] < 0 || slots[t] >= cache_rows) return -2;
#pragma omp parallel for num_threads(threads) if (tokens >= PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + positions[t] * half, *s = sin + positions[t] * half;
        for (int64_t h = 0; h < q_heads + kv_heads; h++) {
            const int64_t from = t * width + h * head_dim;
            void *dest = h < q_heads ? q_out : k_cache;
            const int64_t to = h < q_heads ? (t * q_heads + h) * head_dim
                                           : (slots[t] * kv_heads + h - q_heads) * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = load(qkv, dtype, from + i), x2 = load(qkv, dtype, from + half + i);
                const float first = x1 * c[i] - x2 * s[i], second = x2 * c[i] + x1 * s[i];
                store(dest, dtype, to + i, first);
                store(dest, dtype, to + half + i, second);
            }
        }
        const int64_t element = dtype == BF16 ? 2 : 4, v_from = t * width + (q_heads + kv_heads) * head_dim;
        memcpy((char *)v_cache + slots[t] * kv_heads * head_dim * element, (const char *)qkv + v_from * element,
               (size_t)(kv_heads * head_dim * element));
    }
    return 0;
}
