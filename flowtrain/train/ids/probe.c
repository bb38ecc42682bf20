/* An ID table's hot loop, compiled: the key -> row lookup (KeyIndex.lookup) and, at inference, that lookup fused
 * with the rows' gather (IdTable.vectors). flowtrain/train/ids/key_index.py holds the layout and the numpy path that
 * does the same lookup; flowtrain/train/ids/compiled.py loads this (built at install by setup.py as an optional
 * extension) and calls it through ctypes: plain C, no Python API.
 *
 * The layout (KeyIndex): row_key[row] is each row's key; slots[] (int32) hold a row number, EMPTY (-1: never used)
 * or TOMB (-2: removed); a key's home slot is the high 32 bits of its hash scaled to n_slots (Lemire's
 * multiply-shift), and its probe path runs from there, slot after slot, wrapping, to the key or the first EMPTY.
 *
 * A lookup's cost is its cache misses: a home slot, then the key of the row it names, then (a gather) the row: reads
 * of tables of megabytes, each waiting for the one before. So the keys go through a pipeline of three stages, each
 * AHEAD keys behind the one before: key i's home slot is prefetched while key i - AHEAD reads its home slot and
 * prefetches that row's key and vector (most keys sit at home: the slots are at most 70% full) and key i - 2 AHEAD
 * walks its probe path and copies its row. The misses of 2 AHEAD keys are in flight at once instead of one after
 * another. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define EMPTY (-1)
#define AHEAD 16
#define RING 64 /* a power of two above 2 * AHEAD: the keys in the pipeline */

static inline uint64_t home_slot(int64_t key, uint64_t n_slots)
{
    uint64_t x = (uint64_t)key;
    uint64_t h = (x ^ (x >> 32)) * UINT64_C(0x9E3779B97F4A7C15);
    return ((h >> 32) * n_slots) >> 32;
}

static inline void prefetch_row(const char *p, int64_t row_bytes)
{
    for (int64_t o = 0; o < row_bytes; o += 64)
        __builtin_prefetch(p + o);
}

/* The row of key (-1: none), from its home slot s whose content r was read already. */
static inline int64_t walk(int64_t key, uint64_t s, int32_t r, const int32_t *slots, uint64_t n_slots,
                           const int64_t *row_key)
{
    for (uint64_t step = 0; step < n_slots; step++) {
        if (r == EMPTY)
            return -1;
        if (r >= 0 && row_key[r] == key)
            return r;
        if (++s == n_slots)
            s = 0;
        r = slots[s];
    }
    return -1;
}

/* rows[i]: the row of keys[i], -1 where it has none; returns how many have none. src (NULL: no gather): a matrix of
 * row_bytes a row, out[i] = src[rows[i]], fallback where rows[i] is -1. */
static inline __attribute__((always_inline)) int64_t lookup(const int64_t *keys, int64_t n, const int32_t *slots, int64_t n_slots, const int64_t *row_key,
                      const char *src, int64_t row_bytes, const char *fallback, int64_t *rows, char *out)
{
    uint64_t home[RING];
    int32_t first[RING];
    int64_t missing = 0;
    for (int64_t i = 0; i < n + 2 * AHEAD; i++) {
        if (i < n) {
            home[i % RING] = home_slot(keys[i], (uint64_t)n_slots);
            __builtin_prefetch(&slots[home[i % RING]]);
        }
        int64_t b = i - AHEAD;
        if (b >= 0 && b < n) {
            int32_t r = first[b % RING] = slots[home[b % RING]];
            if (r >= 0) {
                __builtin_prefetch(&row_key[r]);
                if (src)
                    prefetch_row(src + r * row_bytes, row_bytes);
            }
        }
        int64_t c = i - 2 * AHEAD;
        if (c >= 0) {
            int64_t row = walk(keys[c], home[c % RING], first[c % RING], slots, (uint64_t)n_slots, row_key);
            rows[c] = row;
            missing += row < 0;
            if (src)
                memcpy(out + c * row_bytes, row >= 0 ? src + row * row_bytes : fallback, (size_t)row_bytes);
        }
    }
    return missing;
}

/* Each key's row, -1 where it has none; returns how many have none. */
int64_t flowtrain_ids_lookup(const int64_t *keys, int64_t n, const int32_t *slots, int64_t n_slots,
                             const int64_t *row_key, int64_t *rows)
{
    return lookup(keys, n, slots, n_slots, row_key, NULL, 0, NULL, rows, NULL);
}

/* The lookup and the gather in one pass (inference): rows as flowtrain_ids_lookup's, and out[i] = src[rows[i]]
 * (row_bytes each; fallback where none); returns how many have none. */
int64_t flowtrain_ids_embed(const int64_t *keys, int64_t n, const int32_t *slots, int64_t n_slots,
                            const int64_t *row_key, const char *src, int64_t row_bytes, const char *fallback,
                            int64_t *rows, char *out)
{
    if (row_bytes == 64) /* dimension 16 in float32, 8 in float64: the copy's size a constant the compiler inlines */
        return lookup(keys, n, slots, n_slots, row_key, src, 64, fallback, rows, out);
    return lookup(keys, n, slots, n_slots, row_key, src, row_bytes, fallback, rows, out);
}
