/* The fp8 KV codec's CPU kernels (built by kv_transfer/codec_compiled.py, called through ctypes).
 *
 * The cache is seen as rows of cells [rows, groups, elems] (groups = K/V x kv heads, elems = block_size
 * x head_dim). encode_* reads the rows a chunk names straight from the cache and writes the payload's
 * e4m3 codes and one float32 scale per group (scale = amax / 448); decode_* writes a payload straight
 * into the destination rows. The arithmetic is torch's, bit for bit:
 *     inv = (1 / amax) * 448 (0 for an all-zero group);  code = e4m3(float(x) * inv)
 *     value = cache_dtype(float(code) * scale)
 * The e4m3 and bfloat16 roundings are done on the float32 bit pattern with integer operations (round to
 * nearest even), so the compiler vectorizes every inner loop (torch's own e4m3 conversion is scalar on
 * CPUs without AVX-512, ~4x slower).
 * Both return 0, or -1 (and touch nothing) when a row is outside [0, num_cells); encode returns 1 when a
 * group held NaN or Inf (its scale is then not finite), which the caller refuses.
 */
#include <stdint.h>
#include <string.h>

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* |y| <= 448 (+ rounding) -> e4m3fn code */
static inline uint8_t e4m3_code(float y) {
    uint32_t bits = f32_bits(y);
    uint32_t a = bits & 0x7FFFFFFFu;
    /* normal: keep 3 mantissa bits rounded to nearest even, rebias the exponent (127 -> 7: 120 << 3) */
    int32_t normal = (int32_t)((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - 960;
    /* subnormal (|y| < 2^-6): |y| * 2^9 rounded to nearest even by adding 2^23; 8 is the smallest normal */
    int32_t sub = (int32_t)(f32_bits(bits_f32(a) * 512.0f + 8388608.0f) - 0x4B000000u);
    int32_t code = a < 0x3C800000u ? sub : normal;
    code = code < 0x7E ? code : 0x7E;
    return (uint8_t)((uint32_t)code | ((bits >> 24) & 0x80u));
}

static inline float e4m3_value(uint8_t c) {
    uint32_t em = c & 0x7Fu;
    float normal = bits_f32((em << 20) + (120u << 23));
    float sub = (float)(int32_t)em * 0.001953125f; /* m * 2^-9 */
    float v = em > 7u ? normal : sub;
    return bits_f32(f32_bits(v) | ((uint32_t)(c & 0x80u) << 24));
}

/* one cache element <-> float32, and the bit pattern used for amax (ordered like |x| for finite x) */
static inline float bf16_load(uint16_t h) { return bits_f32((uint32_t)h << 16); }
static inline uint16_t bf16_store(float f) {
    uint32_t u = f32_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline uint16_t bf16_abs_bits(uint16_t h) { return h & 0x7FFFu; }
static inline float bf16_abs_value(uint16_t bits) { return bf16_load(bits); }

static inline float f32_load(uint32_t u) { return bits_f32(u); }
static inline uint32_t f32_store(float f) { return f32_bits(f); }
static inline uint32_t f32_abs_bits(uint32_t u) { return u & 0x7FFFFFFFu; }
static inline float f32_abs_value(uint32_t bits) { return bits_f32(bits); }

static int rows_in_range(const int64_t *rows, int64_t num_rows, int64_t num_cells) {
    for (int64_t r = 0; r < num_rows; r++)
        if (rows[r] < 0 || rows[r] >= num_cells) return 0;
    return 1;
}

#define CODEC_KERNELS(NAME, T)                                                                                   \
    static void encode_group_##NAME(const T *restrict src, uint8_t *restrict dst, int64_t n, float *scale) {     \
        T amax_bits = 0;                                                                                         \
        for (int64_t e = 0; e < n; e++) {                                                                        \
            T b = NAME##_abs_bits(src[e]);                                                                       \
            amax_bits = b > amax_bits ? b : amax_bits;                                                           \
        }                                                                                                        \
        float amax = NAME##_abs_value(amax_bits);                                                                \
        float inv = amax > 0.0f ? (1.0f / amax) * 448.0f : 0.0f;                                                 \
        *scale = amax / 448.0f;                                                                                  \
        for (int64_t e = 0; e < n; e++) dst[e] = e4m3_code(NAME##_load(src[e]) * inv);                           \
    }                                                                                                            \
                                                                                                                 \
    int encode_##NAME(const T *cells, int64_t num_cells, const int64_t *rows, int64_t num_rows, int64_t groups,  \
                      int64_t elems, uint8_t *data, float *scales) {                                             \
        if (!rows_in_range(rows, num_rows, num_cells)) return -1;                                                \
        uint32_t nonfinite = 0;                                                                                  \
        for (int64_t r = 0; r < num_rows; r++)                                                                   \
            for (int64_t g = 0; g < groups; g++) {                                                               \
                float *scale = scales + r * groups + g;                                                          \
                encode_group_##NAME(cells + (rows[r] * groups + g) * elems, data + (r * groups + g) * elems,     \
                                    elems, scale);                                                               \
                nonfinite |= (f32_bits(*scale) & 0x7F800000u) == 0x7F800000u;                                    \
            }                                                                                                    \
        return nonfinite ? 1 : 0;                                                                                \
    }                                                                                                            \
                                                                                                                 \
    static void decode_group_##NAME(const uint8_t *restrict src, T *restrict dst, int64_t n, float scale) {      \
        for (int64_t e = 0; e < n; e++) dst[e] = NAME##_store(e4m3_value(src[e]) * scale);                       \
    }                                                                                                            \
                                                                                                                 \
    int decode_##NAME(const uint8_t *data, const float *scales, int64_t num_rows, int64_t groups, int64_t elems,  \
                      T *cells, int64_t num_cells, const int64_t *rows) {                                        \
        if (!rows_in_range(rows, num_rows, num_cells)) return -1;                                                \
        for (int64_t r = 0; r < num_rows; r++)                                                                   \
            for (int64_t g = 0; g < groups; g++)                                                                 \
                decode_group_##NAME(data + (r * groups + g) * elems, cells + (rows[r] * groups + g) * elems,     \
                                    elems, scales[r * groups + g]);                                              \
        return 0;                                                                                                \
    }

CODEC_KERNELS(bf16, uint16_t)
CODEC_KERNELS(f32, uint32_t)
