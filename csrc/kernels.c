/* Reduction kernels (see kernels.h). float16 and bfloat16 are widened to float32, combined,
 * and rounded back to nearest-even: the same single rounding numpy (float16) and torch
 * (bfloat16) apply, so results match them bit for bit. Integer sums wrap like numpy's.
 *
 * Note [NaN in min and max]: floating min and max propagate NaN as numpy's np.minimum and
 * np.maximum (and torch's) do: the result is NaN wherever either operand is, whichever rank or
 * slice holds it. Each returns one of its operands unchanged: a (dst) when a is NaN, else b
 * when b is NaN, else the smaller (larger) one, a on a tie. float16 and bfloat16 compare
 * their widened values but store the chosen operand's own 16 bits (exact: no rounding, and a
 * NaN's payload kept as numpy keeps it). The same rule is mpidp/engine/host_ops_numpy.py's and
 * mpidp/engine/gpu/kernels/elementwise.cuh's. Integers keep the plain compare. */
#include "kernels.h"
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, f;
    if (exp == 0) {
        if (man == 0) {
            f = sign;
        } else { /* subnormal: normalise the mantissa */
            exp = 113;
            while (!(man & 0x400u)) { man <<= 1; exp--; }
            f = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 0x1f) {
        f = sign | 0x7f800000u | (man << 13);
    } else {
        f = sign | ((exp + 112) << 23) | (man << 13);
    }
    float out;
    memcpy(&out, &f, 4);
    return out;
}

static inline uint16_t f32_to_f16(float x) {
    const uint32_t inf32 = 255u << 23, max16 = (127u + 16u) << 23;
    const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    uint32_t f;
    memcpy(&f, &x, 4);
    uint32_t sign = f & 0x80000000u;
    f ^= sign;
    uint16_t o;
    if (f >= max16) {
        o = (f > inf32) ? 0x7e00u : 0x7c00u;
    } else if (f < (113u << 23)) { /* result is subnormal or zero: let the FPU round */
        float ff, magic;
        memcpy(&ff, &f, 4);
        memcpy(&magic, &denorm_magic, 4);
        ff += magic;
        uint32_t r;
        memcpy(&r, &ff, 4);
        o = (uint16_t)(r - denorm_magic);
    } else { /* normal: rebias, round to nearest even on the dropped 13 bits */
        uint32_t odd = (f >> 13) & 1u;
        f += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
        o = (uint16_t)(f >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define SUM(a, b) ((a) + (b))
/* Integer min/max. */
#define MIN(a, b) ((b) < (a) ? (b) : (a))
#define MAX(a, b) ((b) > (a) ? (b) : (a))
/* Floating min/max (Note [NaN in min and max]): b is taken when a is not NaN and b is not
 * >= a (<= a), i.e. b is smaller (larger) or NaN. Both compares always run (& not &&: GCC
 * will not speculate a compare that may raise FE_INVALID, and a branch stops vectorising),
 * then a select: vectorised as MIN and MAX are (cmpps, and, blend). */
#define FMIN_TAKES_B(a, b) (((a) == (a)) & !((b) >= (a)))
#define FMAX_TAKES_B(a, b) (((a) == (a)) & !((b) <= (a)))
#define FMIN(a, b) (FMIN_TAKES_B(a, b) ? (b) : (a))
#define FMAX(a, b) (FMAX_TAKES_B(a, b) ? (b) : (a))

#define NATIVE_LOOP(T, OPM)                                                         \
    do {                                                                            \
        T *d = (T *)dst;                                                            \
        const T *x = (const T *)a, *y = (const T *)b;                               \
        for (size_t i = 0; i < count; i++) d[i] = OPM(x[i], y[i]);                 \
    } while (0)

/* Integer sums wrap (two's complement) as numpy's do; computed unsigned to avoid UB. */
#define WRAP_SUM_LOOP(T, U)                                                         \
    do {                                                                            \
        T *d = (T *)dst;                                                            \
        const T *x = (const T *)a, *y = (const T *)b;                               \
        for (size_t i = 0; i < count; i++) d[i] = (T)((U)x[i] + (U)y[i]);          \
    } while (0)

#define WIDE_LOOP(TO_F, FROM_F, OPM)                                                \
    do {                                                                            \
        uint16_t *d = (uint16_t *)dst;                                              \
        const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)b;          \
        for (size_t i = 0; i < count; i++) {                                        \
            float u = TO_F(x[i]), v = TO_F(y[i]);                                   \
            d[i] = FROM_F(OPM(u, v));                                               \
        }                                                                           \
    } while (0)

/* 16-bit float min/max: compared widened, the chosen operand's bits stored as they are. */
#define WIDE_PICK_LOOP(TO_F, TAKES_B)                                               \
    do {                                                                            \
        uint16_t *d = (uint16_t *)dst;                                              \
        const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)b;          \
        for (size_t i = 0; i < count; i++) {                                        \
            float u = TO_F(x[i]), v = TO_F(y[i]);                                   \
            d[i] = TAKES_B(u, v) ? y[i] : x[i];                                     \
        }                                                                           \
    } while (0)

#define BY_OP(LOOP, ...)                                                            \
    switch (op) {                                                                   \
    case OP_SUM: LOOP(__VA_ARGS__, SUM); return 0;                                  \
    case OP_MIN: LOOP(__VA_ARGS__, MIN); return 0;                                  \
    case OP_MAX: LOOP(__VA_ARGS__, MAX); return 0;                                  \
    default: return -1;                                                             \
    }

#define BY_FLOAT_OP(T)                                                              \
    switch (op) {                                                                   \
    case OP_SUM: NATIVE_LOOP(T, SUM); return 0;                                     \
    case OP_MIN: NATIVE_LOOP(T, FMIN); return 0;                                    \
    case OP_MAX: NATIVE_LOOP(T, FMAX); return 0;                                    \
    default: return -1;                                                             \
    }

#define BY_WIDE_OP(TO_F, FROM_F)                                                    \
    switch (op) {                                                                   \
    case OP_SUM: WIDE_LOOP(TO_F, FROM_F, SUM); return 0;                            \
    case OP_MIN: WIDE_PICK_LOOP(TO_F, FMIN_TAKES_B); return 0;                      \
    case OP_MAX: WIDE_PICK_LOOP(TO_F, FMAX_TAKES_B); return 0;                      \
    default: return -1;                                                             \
    }

size_t mp_itemsize(int dtype) {
    static const size_t sizes[DT_COUNT] = {2, 2, 4, 8, 4, 8};
    return (dtype >= 0 && dtype < DT_COUNT) ? sizes[dtype] : 0;
}

int mp_reduce2(void *dst, const void *a, const void *b, size_t count, int dtype, int op) {
    switch (dtype) {
    case DT_F16: BY_WIDE_OP(f16_to_f32, f32_to_f16)
    case DT_BF16: BY_WIDE_OP(bf16_to_f32, f32_to_bf16)
    case DT_F32: BY_FLOAT_OP(float)
    case DT_F64: BY_FLOAT_OP(double)
    case DT_I32:
        if (op == OP_SUM) { WRAP_SUM_LOOP(int32_t, uint32_t); return 0; }
        BY_OP(NATIVE_LOOP, int32_t)
    case DT_I64:
        if (op == OP_SUM) { WRAP_SUM_LOOP(int64_t, uint64_t); return 0; }
        BY_OP(NATIVE_LOOP, int64_t)
    default:
        return -1;
    }
}

/* x / d and x * (1/d) are the same real number when d is a power of two (1/d is exact), so
 * they round alike: such divisors (2, 4, 8 ranks) multiply, which vectorises far better. */
#define SCALE_LOOP(T, LOAD, STORE)                                                  \
    do {                                                                            \
        T *d = (T *)dst;                                                            \
        const T *x = (const T *)src;                                                \
        if (pow2) {                                                                 \
            for (size_t i = 0; i < count; i++) d[i] = STORE(LOAD(x[i]) * inv);      \
        } else {                                                                    \
            for (size_t i = 0; i < count; i++) d[i] = STORE(LOAD(x[i]) / dv);       \
        }                                                                           \
    } while (0)
#define SAME(v) (v)

int mp_divide_into(void *dst, const void *src, size_t count, int dtype, long divisor) {
    int pow2 = divisor > 0 && (divisor & (divisor - 1)) == 0;
    switch (dtype) {
    case DT_F16: {
        float dv = (float)divisor, inv = 1.0f / dv;
        SCALE_LOOP(uint16_t, f16_to_f32, f32_to_f16);
        return 0;
    }
    case DT_BF16: {
        float dv = (float)divisor, inv = 1.0f / dv;
        SCALE_LOOP(uint16_t, bf16_to_f32, f32_to_bf16);
        return 0;
    }
    case DT_F32: {
        float dv = (float)divisor, inv = 1.0f / dv;
        SCALE_LOOP(float, SAME, SAME);
        return 0;
    }
    case DT_F64: {
        double dv = (double)divisor, inv = 1.0 / dv;
        SCALE_LOOP(double, SAME, SAME);
        return 0;
    }
    default:
        return -1;
    }
}

int mp_divide(void *buf, size_t count, int dtype, long divisor) {
    return mp_divide_into(buf, buf, count, dtype, divisor);
}

/* Note [Casting buckets]: float32 <-> float16/bfloat16 with the division in float32 on the
 * way (as SCALE_LOOP divides), rounded once to nearest even: the compression hooks' pack
 * (float32 gradients into a 16-bit bucket) and unpack (back into float32). */
#define CAST_LOOP(TS, TD, LOAD, STORE)                                              \
    do {                                                                            \
        TD *d = (TD *)dst;                                                          \
        const TS *x = (const TS *)src;                                              \
        if (divisor == 1) {                                                         \
            for (size_t i = 0; i < count; i++) d[i] = STORE(LOAD(x[i]));            \
        } else if (pow2) {                                                          \
            for (size_t i = 0; i < count; i++) d[i] = STORE(LOAD(x[i]) * inv);      \
        } else {                                                                    \
            for (size_t i = 0; i < count; i++) d[i] = STORE(LOAD(x[i]) / dv);       \
        }                                                                           \
    } while (0)

int mp_cast_into(void *dst, int dst_dtype, const void *src, int src_dtype, size_t count,
                 long divisor) {
    int pow2 = divisor > 0 && (divisor & (divisor - 1)) == 0;
    float dv = (float)divisor, inv = 1.0f / dv;
    if (divisor < 1) return -1;
    if (src_dtype == DT_F32 && dst_dtype == DT_F16) {
        CAST_LOOP(float, uint16_t, SAME, f32_to_f16);
    } else if (src_dtype == DT_F32 && dst_dtype == DT_BF16) {
        CAST_LOOP(float, uint16_t, SAME, f32_to_bf16);
    } else if (src_dtype == DT_F16 && dst_dtype == DT_F32) {
        CAST_LOOP(uint16_t, float, f16_to_f32, SAME);
    } else if (src_dtype == DT_BF16 && dst_dtype == DT_F32) {
        CAST_LOOP(uint16_t, float, bf16_to_f32, SAME);
    } else {
        return -1;
    }
    return 0;
}

/* Note [Streaming copy]
 * A plain copy (memcpy, numpy's copyto) reads each destination line before writing it (a
 * read for ownership), so it moves three bytes per byte copied; stores that bypass the cache
 * (non-temporal) move two. The benchmark's memory bound is the faster of the two
 * (mpidp/bench/harness.py's memory_ceiling): what the memory system can do, not what one way
 * of copying does. x86-64 always has SSE2's 16-byte movntdq; elsewhere this is memcpy. */
void mp_stream_copy(void *dst, const void *src, size_t n) {
#if defined(__SSE2__)
    char *d = dst;
    const char *s = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
    _mm_sfence(); /* the streamed lines are visible before this returns */
#else
    memcpy(dst, src, n);
#endif
}
