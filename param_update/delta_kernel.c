/* The two loops of a delta (param_update/delta.py's wire format), for elements of 2 or 4 bytes compared
 * bit for bit. Built and loaded by param_update/delta_kernel.py.
 *
 * encode: the positions where `new_` and `old` differ, written as gaps (from 0 to the first, then between
 * neighbours, each at most 65535: a longer gap gets a position every 65535 inside it, sent with its value)
 * and the values of `new_` there. One pass; the compare takes 32 2-byte elements at a time (AVX-512 or AVX2),
 * 16 or 8 4-byte ones, chosen at run time; plain C elsewhere.
 * write: the values written at the positions the gaps stand for, in place.
 */
#include <stdint.h>

#define GAP_LIMIT 65535
#define TOO_MANY (-1)   /* encode: more than `cap` positions */
#define OUT_OF_RANGE (-1) /* write: a position at or past `n` */
#define UNSUPPORTED (-2) /* an element size other than 2 or 4, or a level this CPU lacks */

enum { LEVEL_BEST = 0, LEVEL_PLAIN = 1, LEVEL_AVX2 = 2, LEVEL_AVX512 = 3 };

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86 1
#include <immintrin.h>
#endif

/* one sent position `i` (and the bridge positions before it); leaves the function when `cap` is passed */
#define EMIT(i)                                                              \
    do {                                                                     \
        int64_t at_ = (i);                                                   \
        while (at_ - last > GAP_LIMIT) {                                     \
            if (count >= cap) return TOO_MANY;                               \
            last += GAP_LIMIT;                                               \
            gaps[count] = GAP_LIMIT;                                         \
            values[count++] = a[last];                                       \
        }                                                                    \
        if (count >= cap) return TOO_MANY;                                   \
        gaps[count] = (uint16_t)(at_ - last);                                \
        values[count++] = a[at_];                                            \
        last = at_;                                                          \
    } while (0)

/* NAME: encode elements of type T, STEP at a time by MASK (a bit per differing element of a[i..i+STEP)) */
#define ENCODE(NAME, T, ATTR, STEP, MASK)                                                          \
    ATTR static int64_t NAME(const void *new_, const void *old, int64_t n, uint16_t *gaps,        \
                             void *values_, int64_t cap) {                                        \
        const T *a = new_, *b = old;                                                              \
        T *values = values_;                                                                      \
        int64_t count = 0, last = 0, i = 0;                                                       \
        for (; STEP > 1 && i + STEP <= n; i += STEP) {                                            \
            uint64_t m = (MASK);                                                                  \
            while (m) {                                                                           \
                EMIT(i + __builtin_ctzll(m));                                                     \
                m &= m - 1;                                                                       \
            }                                                                                     \
        }                                                                                         \
        for (; i < n; i++)                                                                        \
            if (a[i] != b[i]) EMIT(i);                                                            \
        return count;                                                                             \
    }

ENCODE(encode16_plain, uint16_t, , 1, 0)
ENCODE(encode32_plain, uint32_t, , 1, 0)

#ifdef HAVE_X86
#define LOAD512(p) _mm512_loadu_si512((const void *)(p))
#define LOAD256(p) _mm256_loadu_si256((const __m256i *)(p))
ENCODE(encode16_avx512, uint16_t, __attribute__((target("avx512f,avx512bw"))), 32,
       _mm512_cmpneq_epi16_mask(LOAD512(a + i), LOAD512(b + i)))
ENCODE(encode32_avx512, uint32_t, __attribute__((target("avx512f"))), 16,
       _mm512_cmpneq_epi32_mask(LOAD512(a + i), LOAD512(b + i)))
/* AVX2: 32 16-bit compares packed to bytes (packs interleaves the 128-bit lanes; the permute restores order) */
ENCODE(encode16_avx2, uint16_t, __attribute__((target("avx2"))), 32,
       ~(uint32_t)_mm256_movemask_epi8(_mm256_permute4x64_epi64(
           _mm256_packs_epi16(_mm256_cmpeq_epi16(LOAD256(a + i), LOAD256(b + i)),
                              _mm256_cmpeq_epi16(LOAD256(a + i + 16), LOAD256(b + i + 16))), 0xD8)))
ENCODE(encode32_avx2, uint32_t, __attribute__((target("avx2"))), 8,
       ~(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(LOAD256(a + i), LOAD256(b + i))))
           & 0xFFu)
#endif

typedef int64_t (*encoder)(const void *, const void *, int64_t, uint16_t *, void *, int64_t);

/* [element size 2, 4][level]: the loops built for this machine (NULL: none) */
static const encoder ENCODERS[2][4] = {
#ifdef HAVE_X86
    {NULL, encode16_plain, encode16_avx2, encode16_avx512},
    {NULL, encode32_plain, encode32_avx2, encode32_avx512},
#else
    {NULL, encode16_plain, NULL, NULL},
    {NULL, encode32_plain, NULL, NULL},
#endif
};

/* the highest level this CPU runs (LEVEL_PLAIN off x86) */
int64_t async_rl_delta_level(void) {
#ifdef HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return LEVEL_AVX512;
    if (__builtin_cpu_supports("avx2")) return LEVEL_AVX2;
#endif
    return LEVEL_PLAIN;
}

/* The delta from `old` to `new_` (n elements of `itemsize` bytes): its count of positions, with gaps[0..count)
 * and values[0..count) written; TOO_MANY when it has more than `cap` (gaps and values hold at least `cap`);
 * UNSUPPORTED for another itemsize or a level above async_rl_delta_level(). `level` 0: the best. */
int64_t async_rl_delta_encode(const void *new_, const void *old, int64_t n, int64_t itemsize, uint16_t *gaps,
                              void *values, int64_t cap, int64_t level) {
    static int64_t best = 0;
    if (!best) best = async_rl_delta_level();
    if (level == LEVEL_BEST) level = best;
    if (level > best || level < LEVEL_PLAIN || (itemsize != 2 && itemsize != 4)) return UNSUPPORTED;
    return ENCODERS[itemsize / 4][level](new_, old, n, gaps, values, cap);
}

#define WRITE(NAME, T)                                                                                \
    static int64_t NAME(T *out, int64_t n, const uint16_t *gaps, const T *values, int64_t count) {  \
        int64_t pos = 0;                                                                             \
        for (int64_t k = 0; k < count; k++) {                                                        \
            pos += gaps[k];                                                                          \
            if (pos >= n) return OUT_OF_RANGE;                                                       \
            out[pos] = values[k];                                                                    \
        }                                                                                            \
        return 0;                                                                                    \
    }

WRITE(write16, uint16_t)
WRITE(write32, uint32_t)

/* out[0..n) with values[k] written at the k-th position the gaps stand for, in place; 0, OUT_OF_RANGE when a
 * position is at or past n (the values before it are written), or UNSUPPORTED. */
int64_t async_rl_delta_write(void *out, int64_t n, int64_t itemsize, const uint16_t *gaps, const void *values,
                             int64_t count) {
    if (itemsize == 2) return write16(out, n, gaps, values, count);
    if (itemsize == 4) return write32(out, n, gaps, values, count);
    return UNSUPPORTED;
}
