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
/* Query heads whose scores and values one pass over a chunk computes together. */
#define HEAD_BLOCK 4

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

/* widen, writing element i to dst[i * stride]. */
static inline void widen_strided(const void *src, int dtype, int64_t n, float *dst, int64_t stride) {
    if (dtype == CACHE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) {
            union { uint32_t u; float f; } v;
            v.u = (uint32_t)s[i] << 16;
            dst[i * stride] = v.f;
        }
    } else if (dtype == CACHE_F16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i * stride] = half_to_float(s[i]);
    } else {
        const float *s = (const float *)src;
        for (int64_t i = 0; i < n; i++) dst[i * stride] = s[i];
    }
}

/* A float rounded to the nearest bfloat16, ties to even (NaN stays a quiet NaN), as torch rounds it. */
static inline uint16_t float_to_bf16(float x) {
    union { float f; uint32_t u; } v = {x};
    if (x != x) return 0x7fc0;
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
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
    const char *q; /* [T, Hq, head_dim] in q_dtype */
    int q_dtype, out_dtype; /* CACHE_F32 or CACHE_BF16 for out */
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
    char *out; /* [T, Hq, value_dim] in out_dtype */
} attention_args;

/* A query's state through the chunks, per head of its group: running maximum, sum and values. */
typedef struct {
    float *keys_t;  /* [head_dim, chunk_pad]: the chunk's keys, transposed */
    float *values;  /* [chunk, value_dim] */
    float *scores;  /* [HEAD_BLOCK, chunk_pad] */
    float *acc;     /* [tile rows * group, value_dim] */
    float *queries; /* [tile rows * group, head_dim]: the tile's queries of one KV head, widened */
    float *m, *l;   /* [tile rows * group] */
} scratch;

/* Columns of keys_t: the chunk rounded up to SCORE_BLOCK, the padding columns zeros. */
#define SCORE_BLOCK 32

static inline int64_t chunk_pad(int64_t chunk) { return (chunk + SCORE_BLOCK - 1) / SCORE_BLOCK * SCORE_BLOCK + LANES; }

/* Widen keys and values of positions start .. start + n - 1 of one sequence and KV head, block by block, asking
   for each next block's rows (up to position `end`, excluded) while one is widened. */
static void load_chunk(const attention_args *a, const scratch *s, int32_t seq, int64_t kv_head, int64_t start,
                       int64_t n, int64_t end) {
    const int64_t dk = a->head_dim, dv = a->value_dim, pad = chunk_pad(a->chunk);
    const int64_t k_row = a->n_kv_heads * a->k_width, v_row = a->n_kv_heads * a->v_width;
    for (int64_t j = 0; j < n;) {
        const int64_t pos = start + j, offset = pos % a->block_size;
        const int64_t block = a->block_tables[(int64_t)seq * a->table_width + pos / a->block_size];
        const int64_t take = a->block_size - offset < n - j ? a->block_size - offset : n - j;
        const int64_t first = block * a->block_size + offset;
        const int64_t next_pos = start + j + take;
        if (next_pos < end) {
            const int64_t next = a->block_tables[(int64_t)seq * a->table_width + next_pos / a->block_size];
            const int64_t next_take = a->block_size < end - next_pos ? a->block_size : end - next_pos;
            for (int64_t i = 0; i < next_take; i++) {
                const char *k = a->k_cache + ((next * a->block_size + i) * k_row + kv_head * a->k_width) * a->element;
                const char *v = a->v_cache + ((next * a->block_size + i) * v_row + kv_head * a->v_width) * a->element;
                for (int64_t byte = 0; byte < dk * a->element; byte += 64) __builtin_prefetch(k + byte);
                for (int64_t byte = 0; byte < dv * a->element; byte += 64) __builtin_prefetch(v + byte);
            }
        }
        for (int64_t i = 0; i < take; i++, j++) {
            widen_strided(a->k_cache + ((first + i) * k_row + kv_head * a->k_width) * a->element, a->dtype, dk,
                          s->keys_t + j, pad);
            widen(a->v_cache + ((first + i) * v_row + kv_head * a->v_width) * a->element, a->dtype, dv,
                  s->values + j * dv);
        }
    }
    for (int64_t d = 0; d < dk; d++)
        for (int64_t j = n; j < pad; j++) s->keys_t[d * pad + j] = 0.0f;
}

/* scores[k][j] = q[k] . key j for the chunk's first n keys and up to HEAD_BLOCK query heads, each score a chain of
   multiply-adds in element order (count < HEAD_BLOCK: the rest of the block repeats q[0], and is not stored). */
static void chunk_scores(const float *const *q, int count, const float *keys_t, int64_t dk, int64_t pad, int64_t n,
                         float *scores) {
    for (int64_t j0 = 0; j0 < n; j0 += SCORE_BLOCK) {
        float acc[HEAD_BLOCK][SCORE_BLOCK] = {{0}};
        for (int64_t d = 0; d < dk; d++) {
            const float *row = keys_t + d * pad + j0;
            for (int k = 0; k < HEAD_BLOCK; k++) {
                const float qd = q[k][d];
                for (int i = 0; i < SCORE_BLOCK; i++) acc[k][i] = fmaf(qd, row[i], acc[k][i]);
            }
        }
        for (int k = 0; k < count; k++) memcpy(scores + k * pad + j0, acc[k], sizeof(acc[k]));
    }
}

/* acc[k][d] += p[k][j] * value j [d] for j = 0 .. n - 1 in order, for up to HEAD_BLOCK heads at once (as
   chunk_scores, a short block repeats the first head and does not store it). */
static void chunk_values(float *const *acc, const float *const *p, int count, const float *values, int64_t dv,
                         int64_t n) {
    int64_t d0 = 0;
    for (; d0 + LANES <= dv; d0 += LANES) {
        float a[HEAD_BLOCK][LANES];
        for (int k = 0; k < HEAD_BLOCK; k++) memcpy(a[k], acc[k] + d0, sizeof(a[k]));
        for (int64_t j = 0; j < n; j++) {
            const float *v = values + j * dv + d0;
            for (int k = 0; k < HEAD_BLOCK; k++) {
                const float pk = p[k][j];
                for (int i = 0; i < LANES; i++) a[k][i] = fmaf(pk, v[i], a[k][i]);
            }
        }
        for (int k = 0; k < count; k++) memcpy(acc[k] + d0, a[k], sizeof(a[k]));
    }
    for (int k = 0; k < count; k++)
        for (int64_t j = 0; j < n; j++)
            for (int64_t d = d0; d < dv; d++) acc[k][d] = fmaf(p[k][j], values[j * dv + d], acc[k][d]);
}

/* One chunk of keys for `count` query heads of a tile (tile index i = row * group + head): the first n_of[k] keys of
   the chunk, those before lowest_of[k] masked. */
static void attend_chunk(const attention_args *a, const scratch *s, int64_t first, int64_t first_head, int64_t group,
                         int64_t start, const int64_t *active, const int64_t *n_of, const int64_t *lowest_of,
                         int count) {
    const int64_t dk = a->head_dim, dv = a->value_dim, pad = chunk_pad(a->chunk);
    const float *q[HEAD_BLOCK];
    float *acc[HEAD_BLOCK];
    int64_t n_max = 0;
    for (int k = 0; k < HEAD_BLOCK; k++) { /* a short block repeats its first head, unstored */
        const int64_t i = active[k < count ? k : 0], row = i / group, head = i % group;
        q[k] = s->queries + (row * group + head) * dk;
        acc[k] = s->acc + i * dv;
    }
    for (int k = 0; k < count; k++) n_max = n_of[k] > n_max ? n_of[k] : n_max;
    chunk_scores(q, count, s->keys_t, dk, pad, n_max, s->scores);
    /* The heads that have seen a key by the end of this chunk, whose values it adds to. */
    float *seen_acc[HEAD_BLOCK];
    const float *seen_p[HEAD_BLOCK];
    int64_t seen_n[HEAD_BLOCK];
    int seen = 0;
    for (int k = 0; k < count; k++) {
        const int64_t i = active[k], n = n_of[k];
        float *scores = s->scores + k * pad;
        float top = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            float score = scores[j] * a->scale;
            if (a->softcap > 0.0f) score = soft_capped(score, a->softcap);
            scores[j] = start + j < lowest_of[k] ? -INFINITY : score;
            top = scores[j] > top ? scores[j] : top;
        }
        const float m_new = top > s->m[i] ? top : s->m[i];
        if (m_new == -INFINITY) continue; /* no key of this chunk is seen, nor was one before */
        const float keep = exp_nonpositive(s->m[i] - m_new);
        for (int64_t j = 0; j < n; j++) scores[j] = exp_nonpositive(scores[j] - m_new);
        s->l[i] = fmaf(s->l[i], keep, lane_sum(scores, n));
        for (int64_t d = 0; d < dv; d++) acc[k][d] *= keep;
        s->m[i] = m_new;
        seen_acc[seen] = acc[k];
        seen_p[seen] = scores;
        seen_n[seen++] = n;
    }
    if (!seen) return;
    int64_t n_min = INT64_MAX;
    for (int k = 0; k < seen; k++) n_min = seen_n[k] < n_min ? seen_n[k] : n_min;
    for (int k = seen; k < HEAD_BLOCK; k++) { /* a short block repeats its first head, unstored */
        seen_acc[k] = seen_acc[0];
        seen_p[k] = seen_p[0];
    }
    /* Each head's values in position order: the keys every head of the block reaches together, then each head's
       own rest. */
    chunk_values(seen_acc, seen_p, seen, s->values, dv, n_min);
    for (int k = 0; k < seen; k++)
        if (seen_n[k] > n_min) {
            float *one[HEAD_BLOCK] = {seen_acc[k], seen_acc[k], seen_acc[k], seen_acc[k]};
            const float *rest = seen_p[k] + n_min, *weights[HEAD_BLOCK] = {rest, rest, rest, rest};
            chunk_values(one, weights, 1, s->values + n_min * dv, dv, seen_n[k] - n_min);
        }
}

/* Queries tokens first .. first + rows - 1 (one sequence's, in the step's order) and one KV head. */
static void attend_tile(const attention_args *a, const scratch *s, int64_t first, int64_t rows, int64_t kv_head) {
    const int64_t group = a->n_heads / a->n_kv_heads, dv = a->value_dim, chunk = a->chunk;
    const int64_t first_head = kv_head * group;
    const int32_t seq = a->query_seq[first];
    int64_t start_all = INT64_MAX, last_all = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t pos = a->query_pos[first + r];
        const int64_t lowest = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
        start_all = lowest / chunk * chunk < start_all ? lowest / chunk * chunk : start_all;
        last_all = pos > last_all ? pos : last_all;
    }
    const int64_t q_element = a->q_dtype == CACHE_F32 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++)
        widen(a->q + ((first + r) * a->n_heads + first_head) * a->head_dim * q_element, a->q_dtype,
              group * a->head_dim, s->queries + r * group * a->head_dim);
    for (int64_t i = 0; i < rows * group; i++) {
        s->m[i] = -INFINITY;
        s->l[i] = 0.0f;
        memset(s->acc + i * dv, 0, (size_t)dv * sizeof(float));
    }
    for (int64_t start = start_all; start <= last_all; start += chunk) {
        const int64_t n_all = start + chunk <= last_all + 1 ? chunk : last_all + 1 - start;
        load_chunk(a, s, seq, kv_head, start, n_all, last_all + 1);
        /* The query heads that see some key of this chunk, HEAD_BLOCK at a time. */
        int64_t active[HEAD_BLOCK], n_of[HEAD_BLOCK], lowest_of[HEAD_BLOCK];
        int count = 0;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t pos = a->query_pos[first + r];
            const int64_t lowest = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
            if (start > pos || start + chunk <= lowest / chunk * chunk) continue; /* not one of this query's chunks */
            for (int64_t h = 0; h < group; h++) {
                active[count] = r * group + h;
                n_of[count] = start + chunk <= pos + 1 ? chunk : pos + 1 - start;
                lowest_of[count] = lowest;
                if (++count == HEAD_BLOCK) {
                    attend_chunk(a, s, first, first_head, group, start, active, n_of, lowest_of, count);
                    count = 0;
                }
            }
        }
        if (count) attend_chunk(a, s, first, first_head, group, start, active, n_of, lowest_of, count);
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
            const int64_t at = ((first + r) * a->n_heads + first_head + h) * dv;
            for (int64_t d = 0; d < dv; d++) acc[d] = l > 0.0f ? acc[d] / l : 0.0f;
            if (a->out_dtype == CACHE_BF16) {
                uint16_t *out = (uint16_t *)a->out + at;
                for (int64_t d = 0; d < dv; d++) out[d] = float_to_bf16(acc[d]);
            } else {
                memcpy((float *)a->out + at, acc, (size_t)dv * sizeof(float));
            }
        }
    }
}

/* Whether every query's sequence is a row of the block tables, its position within the row's blocks, and every block
   its keys sit in a block of the cache. */
static int indices_fit(const int32_t *block_tables, int64_t sequences, int64_t table_width, int64_t blocks,
                       int64_t block_size, const int32_t *query_seq, const int32_t *query_pos, int64_t n_tokens) {
    for (int64_t t = 0; t < n_tokens; t++) {
        const int64_t seq = query_seq[t], pos = query_pos[t];
        if (seq < 0 || seq >= sequences || pos < 0 || pos / block_size >= table_width) return 0;
        for (int64_t b = 0; b <= pos / block_size; b++) {
            const int64_t block = block_tables[seq * table_width + b];
            if (block < 0 || block >= blocks) return 0;
        }
    }
    return 1;
}

/* Returns 0; -1 when its scratch memory could not be had, -2 when an index falls outside the tables or the cache
   (nothing is written then). */
int stackpin_paged_attention(const void *q, int q_dtype, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                             const void *k_cache, const void *v_cache, int dtype, int64_t blocks, int64_t block_size,
                             int64_t n_kv_heads, int64_t k_width, int64_t v_width, int64_t value_dim,
                             const int32_t *block_tables, int64_t sequences, int64_t table_width,
                             const int32_t *query_seq,
                             const int32_t *query_pos, float scale, float softcap, int64_t window,
                             const float *sinks, int64_t chunk, void *out, int out_dtype, int threads) {
    const attention_args a = {.q = (const char *)q, .q_dtype = q_dtype, .out_dtype = out_dtype,
                              .k_cache = (const char *)k_cache, .v_cache = (const char *)v_cache,
                              .dtype = dtype, .element = dtype == CACHE_F32 ? 4 : 2, .block_size = block_size,
                              .n_kv_heads = n_kv_heads, .n_heads = n_heads, .head_dim = head_dim,
                              .k_width = k_width, .v_width = v_width, .value_dim = value_dim,
                              .block_tables = block_tables, .table_width = table_width, .query_seq = query_seq,
                              .query_pos = query_pos, .scale = scale, .softcap = softcap, .window = window,
                              .sinks = sinks, .chunk = chunk, .out = (char *)out};
    if (!indices_fit(block_tables, sequences, table_width, blocks, block_size, query_seq, query_pos, n_tokens))
        return -2;
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
    const int64_t floats = head_dim * pad + chunk * value_dim + HEAD_BLOCK * pad
                          + tile_rows * group * (value_dim + head_dim + 2);
    if (threads < 1) threads = 1;
    float *memory = malloc((size_t)(floats * threads) * sizeof(float));
    if (memory == NULL) {
        free(tiles);
        return -1;
    }
    const int64_t items = n_tiles * n_kv_heads;
    /* A tile's KV heads on one thread, one after the other, while there are tiles enough to share: they read the same
       cache lines. */
    const int64_t together = n_tiles >= 2 * threads ? n_kv_heads : 1;
#pragma omp parallel num_threads(threads)
    {
        scratch s;
        s.keys_t = memory + floats * omp_get_thread_num();
        s.values = s.keys_t + head_dim * pad;
        s.scores = s.values + chunk * value_dim;
        s.acc = s.scores + HEAD_BLOCK * pad;
        s.m = s.acc + tile_rows * group * value_dim;
        s.l = s.m + tile_rows * group;
        s.queries = s.l + tile_rows * group;
#pragma omp for schedule(dynamic, together)
        for (int64_t item = 0; item < items; item++) {
            const int64_t tile = item / n_kv_heads;
            attend_tile(&a, &s, tiles[tile], tiles[tile + 1] - tiles[tile], item % n_kv_heads);
        }
    }
    free(memory);
    free(tiles);
    return 0;
}
