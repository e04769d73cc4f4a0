/* The CPU's attention over the paged KV cache, each query in an order fixed by its own position.

   A query's keys are taken in chunks of `chunk` tokens on a grid fixed at absolute positions (chunk c holds positions
   c * chunk .. c * chunk + chunk - 1). Per chunk and head: each score is a chain of multiply-adds over the head's
   elements in order, times the scale; the running maximum moves once; the chunk's probabilities are summed with
   element j in lane j % LANES, each lane in order, the lanes added in a fixed tree; and each value element
   accumulates the chunk's keys in position order. So a query's bits depend on its position, the keys and values it
   sees and `chunk`, and on nothing else: not the other queries of the step, not how many threads run, not whether
   its cache was filled by one prefill, in chunks or a token at a time.

   The work is cut into (tile, KV head) items, a tile being up to TILE_QUERIES query heads of consecutive tokens of
   one sequence, so that the tile's queries share each chunk's keys and values, read from the cache and widened to
   float once; an item runs on one thread from start to end. How tokens fall into tiles and items onto threads
   changes no query's arithmetic.

   The arithmetic is IEEE single precision with no reassociation and no contraction (built with -ffp-contract=off,
   never -ffast-math): the fused multiply-adds are explicit `fmaf` calls, exactly rounded wherever they run, and
   `exp` is this file's own polynomial. The bits therefore follow from this source alone, whatever the compiler,
   its vector width or the CPU's instruction set. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
/* Query heads a tile holds at most (its tokens times the group's heads), sharing each widened chunk. */
#define TILE_QUERIES 48

enum cache_dtype { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_F16 = 2 };

/* exp(x) for x <= 0 (or -inf, giving 0): exp(x) = 2^n * exp(r), r = x - n ln 2 in [-ln2/2, ln2/2], exp(r) by its
   Taylor series to r^7 (the remainder is below 1e-8 relative), in Horner form. Arguments below the smallest normal
   result give 0. */
static inline float exp_nonpositive(float x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693145751953125f; /* ln 2 split so that n * ln2_hi is exact for |n| < 2^12 */
    const float ln2_lo = 1.42860682030941723212e-6f;
    float clamped = x < -87.0f ? -87.0f : x;
    float n = rintf(clamped * log2e);
    float r = fmaf(n, -ln2_hi, clamped);
    r = fmaf(n, -ln2_lo, r);
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    float result = p * scale.f;
    return x < -87.0f ? 0.0f : result;
}

/* cap * tanh(s / cap), with tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2 |y|). */
static inline float soft_capped(float s, float cap) {
    float y = s / cap;
    float e = exp_nonpositive(-2.0f * fabsf(y));
    float t = (1.0f - e) / (1.0f + e);
    return cap * (y < 0.0f ? -t : t);
}

/* An IEEE half's value as a float (exact: every half is a float). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exponent == 0x1fu) {
        v.u = sign | 0x7f800000u | (mantissa << 13); /* inf, NaN */
    } else if (exponent != 0) {
        v.u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else { /* zero or subnormal: mantissa * 2^-24, exact in a float */
        v.f = (float)mantissa * 5.9604644775390625e-8f;
        v.u |= sign;
    }
    return v.f;
}

static inline void widen(const void *src, int dtype, int64_t n, float *dst) {
    if (dtype == CACHE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) {
            union { uint32_t u; float f; } v;
            v.u = (uint32_t)s[i] << 16;
            dst[i] = v.f;
        }
    } else if (dtype == CACHE_F16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = half_to_float(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* The sum of x[0 .. n - 1]: element j in lane j % LANES, the lanes added up in a fixed tree. */
static inline float lane_sum(const float *x, int64_t n) {
    float lane[LANES] = {0};
    int64_t j0 = 0;
    for (; j0 + LANES <= n; j0 += LANES)
        for (int i = 0; i < LANES; i++) lane[i] += x[j0 + i];
    for (int i = 0; j0 + i < n; i++) lane[i] += x[j0 + i];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) lane[i] += lane[i + width];
    return lane[0];
}

typedef struct {
    const float *q; /* [T, Hq, head_dim] */
    const char *k_cache, *v_cache; /* [blocks, block_size, Hkv, k_width], [blocks, block_size, Hkv, v_width] */
    int dtype, element;
    int64_t block_size, n_kv_heads, n_heads, head_dim, k_width, v_width, value_dim;
    const int32_t *block_tables; /* [S, table_width] */
    int64_t table_width;
    const int32_t *query_seq, *query_pos; /* [T] */
    float scale, softcap; /* softcap 0: none */
    int64_t window; /* 0: none */
    const float *sinks; /* [Hq] or NULL */
    int64_t chunk;
    float *out; /* [T, Hq, value_dim] */
} attention_args;

/* A query's state through the chunks, per head of its group: running maximum, sum and values. */
typedef struct {
    float *keys_t;  /* [head_dim, chunk_pad]: the chunk's keys, transposed */
    float *values;  /* [chunk, value_dim] */
    float *scores;  /* [chunk_pad] */
    float *acc;     /* [tile rows * group, value_dim] */
    float *m, *l;   /* [tile rows * group] */
} scratch;

/* Columns of keys_t: the chunk rounded up to SCORE_BLOCK, the padding columns zeros. */
#define SCORE_BLOCK 32

static inline int64_t chunk_pad(int64_t chunk) { return (chunk + SCORE_BLOCK - 1) / SCORE_BLOCK * SCORE_BLOCK; }

/* Widen keys and values of positions start .. start + n - 1 of one sequence and KV head, block by block. */
static void load_chunk(const attention_args *a, const scratch *s, int32_t seq, int64_t kv_head, int64_t start,
                       int64_t n) {
    const int64_t dk = a->head_dim, dv = a->value_dim, pad = chunk_pad(a->chunk);
    const int64_t k_row = a->n_kv_heads * a->k_width, v_row = a->n_kv_heads * a->v_width;
    float row[dk];
    for (int64_t j = 0; j < n;) {
        const int64_t pos = start + j, offset = pos % a->block_size;
        const int64_t block = a->block_tables[(int64_t)seq * a->table_width + pos / a->block_size];
        const int64_t take = a->block_size - offset < n - j ? a->block_size - offset : n - j;
        const int64_t first = block * a->block_size + offset;
        for (int64_t i = 0; i < take; i++, j++) {
            widen(a->k_cache + ((first + i) * k_row + kv_head * a->k_width) * a->element, a->dtype, dk, row);
            for (int64_t d = 0; d < dk; d++) s->keys_t[d * pad + j] = row[d];
            widen(a->v_cache + ((first + i) * v_row + kv_head * a->v_width) * a->element, a->dtype, dv,
                  s->values + j * dv);
        }
    }
    for (int64_t d = 0; d < dk; d++)
        for (int64_t j = n; j < pad; j++) s->keys_t[d * pad + j] = 0.0f;
}

/* scores[j] = q . key j for the chunk's keys, each a chain of multiply-adds in element order. */
static void chunk_scores(const float *q, const float *keys_t, int64_t dk, int64_t pad, int64_t n, float *scores) {
    for (int64_t j0 = 0; j0 < n; j0 += SCORE_BLOCK) {
        float acc[SCORE_BLOCK] = {0};
        for (int64_t d = 0; d < dk; d++) {
            const float qd = q[d], *row = keys_t + d * pad + j0;
            for (int i = 0; i < SCORE_BLOCK; i++) acc[i] = fmaf(qd, row[i], acc[i]);
        }
        memcpy(scores + j0, acc, sizeof(acc));
    }
}

/* Queries tokens first .. first + rows - 1 (one sequence's, in the step's order) and one KV head. */
static void attend_tile(const attention_args *a, const scratch *s, int64_t first, int64_t rows, int64_t kv_head) {
    const int64_t group = a->n_heads / a->n_kv_heads, dk = a->head_dim, dv = a->value_dim, chunk = a->chunk;
    const int64_t first_head = kv_head * group, pad = chunk_pad(chunk);
    const int32_t seq = a->query_seq[first];
    int64_t start_all = INT64_MAX, last_all = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pos = a->query_pos[first + r];
        const int64_t lowest = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
        start_all = lowest / chunk * chunk < start_all ? lowest / chunk * chunk : start_all;
        last_all = pos > last_all ? pos : last_all;
    }
    for (int64_t i = 0; i < rows * group; i++) {
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
        memset(s->acc + i * dv, 0, (size_t)dv * sizeof(float));
    }
    for (int64_t start = start_all; start <= last_all; start += chunk) {
        const int64_t n_all = start + chunk <= last_all + 1 ? chunk : last_all + 1 - start;
        load_chunk(a, s, seq, kv_head, start, n_all);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t pos = a->query_pos[first + r];
            const int64_t lowest = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
            if (start > pos || start + chunk <= lowest / chunk * chunk) continue; /* not one of this query's chunks */
            const int64_t n = start + chunk <= pos + 1 ? chunk : pos + 1 - start;
            for (int64_t h = 0; h < group; h++) {
                const int64_t i = r * group + h;
                float *scores = s->scores, *acc = s->acc + i * dv;
                chunk_scores(a->q + ((first + r) * a->n_heads + first_head + h) * dk, s->keys_t, dk, pad, n, scores);
                float top = -INFINITY;
                for (int64_t j = 0; j < n; j++) {
                    float score = scores[j] * a->scale;
                    if (a->softcap > 0.0f) score = soft_capped(score, a->softcap);
                    scores[j] = start + j < lowest ? -INFINITY : score;
                    top = scores[j] > top ? scores[j] : top;
                }
                const float m_new = top > s->m[i] ? top : s->m[i];
                if (m_new == -INFINITY) continue; /* no key of this chunk is seen, nor was one before */
                const float keep = exp_nonpositive(s->m[i] - m_new);
                for (int64_t j = 0; j < n; j++) scores[j] = exp_nonpositive(scores[j] - m_new);
                s->l[i] = fmaf(s->l[i], keep, lane_sum(scores, n));
                for (int64_t d = 0; d < dv; d++) acc[d] *= keep;
                for (int64_t j = 0; j < n; j++) {
                    const float p = scores[j], *v = s->values + j * dv;
                    for (int64_t d = 0; d < dv; d++) acc[d] = fmaf(p, v[d], acc[d]);
                }
                s->m[i] = m_new;
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < group; h++) {
            const int64_t i = r * group + h;
            float m = s->m[i], l = s->l[i], *acc = s->acc + i * dv;
            if (a->sinks != NULL) { /* one more logit that sees no value: it adds to the sum only */
                const float sink = a->sinks[first_head + h], m_new = sink > m ? sink : m;
                const float keep = exp_nonpositive(m - m_new);
                l = fmaf(l, keep, exp_nonpositive(sink - m_new));
                for (int64_t d = 0; d < dv; d++) acc[d] *= keep;
            }
            float *out = a->out + ((first + r) * a->n_heads + first_head + h) * dv;
            for (int64_t d = 0; d < dv; d++) out[d] = l > 0.0f ? acc[d] / l : 0.0f;
        }
    }
}

/* Returns 0, or -1 when its scratch memory could not be had (nothing is written then). */
int stackpin_paged_attention(const float *q, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                             const void *k_cache, const void *v_cache, int dtype, int64_t block_size,
                             int64_t n_kv_heads, int64_t k_width, int64_t v_width, int64_t value_dim,
                             const int32_t *block_tables, int64_t table_width, const int32_t *query_seq,
                             const int32_t *query_pos, float scale, float softcap, int64_t window,
                             const float *sinks, int64_t chunk, float *out, int threads) {
    const int element = dtype == CACHE_F32 ? 4 : 2;
    const attention_args a = {q, (const char *)k_cache, (const char *)v_cache, dtype, element, block_size,
                              n_kv_heads, n_heads, head_dim, k_width, v_width, value_dim, block_tables,
                              table_width, query_seq, query_pos, scale, softcap, window, sinks, chunk, out};
    const int64_t group = n_heads / n_kv_heads, pad = chunk_pad(chunk);
    /* Tiles of consecutive tokens of one sequence share each chunk's widened keys and values; how tokens are
       tiled changes no query's arithmetic. */
    const int64_t tile_rows = group >= TILE_QUERIES ? 1 : TILE_QUERIES / group;
    int64_t *tiles = malloc((size_t)(n_tokens + 1) * sizeof(int64_t));
    if (tiles == NULL) return -1;
    int64_t n_tiles = 0;
    for (int64_t t = 0; t < n_tokens; t++)
        if (n_tiles == 0 || query_seq[t] != query_seq[t - 1] || t - tiles[n_tiles - 1] >= tile_rows)
            tiles[n_tiles++] = t;
    tiles[n_tiles] = n_tokens;
    const int64_t floats = head_dim * pad + chunk * value_dim + pad + tile_rows * group * (value_dim + 2);
    if (threads < 1) threads = 1;
    float *memory = malloc((size_t)(floats * threads) * sizeof(float));
    if (memory == NULL) {
        free(tiles);
        return -1;
    }
    const int64_t items = n_tiles * n_kv_heads;
#pragma omp parallel num_threads(threads)
    {
        scratch s;
        s.keys_t = memory + floats * omp_get_thread_num();
        s.values = s.keys_t + head_dim * pad;
        s.scores = s.values + chunk * value_dim;
        s.acc = s.scores + pad;
        s.m = s.acc + tile_rows * group * value_dim;
        s.l = s.m + tile_rows * group;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t tile = item / n_kv_heads;
            attend_tile(&a, &s, tiles[tile], tiles[tile + 1] - tiles[tile], item % n_kv_heads);
        }
    }
    free(memory);
    free(tiles);
    return 0;
}
