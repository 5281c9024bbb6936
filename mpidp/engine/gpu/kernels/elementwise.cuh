// Element-wise math of mpidp's GPU kernels: loading each dtype into the type it is combined
// in, sum/min/max, the average's division, and rounding back. Written __host__ __device__ so
// tests compile it for the host and compare it bit for bit with the C extension
// (csrc/kernels.c); no CUDA header is needed, so NVRTC, nvcc and a host compiler all take it.
//
// Note [Rounding like the host]: float16 and bfloat16 are widened to float, combined, and
// rounded to nearest even, once per operation, exactly as csrc/kernels.c does; the average
// divides the rounded sum (x * (1/n) when n is a power of two, where the two are the same
// real number, x / n otherwise). On a device the conversions are the hardware's (cvt, the
// same IEEE rounding); on the host the bit-exact software ones below. Only the NaN payloads
// of sums and averages may differ between the two. CuPy compiles every kernel with -ftz=true
// (flush denormals to zero), which would make float arithmetic on denormals — every bfloat16
// subnormal is one — differ from the host: float add, multiply, divide, compare and the NaN
// test are therefore written as PTX instructions without .ftz (tests/unit/test_gpu_kernels.py
// checks the PTX under -ftz=true).
//
// Note [NaN in min and max]: as csrc/kernels.c (and numpy's np.minimum/np.maximum), floating
// min and max propagate NaN and return one of their operands unchanged: dst when dst is NaN,
// else src when src is NaN, else the smaller (larger), dst on a tie. float16 and bfloat16
// compare their widened values but keep the chosen operand's 16 bits (no rounding, payload
// kept), so min and max equal the host bit for bit on a device too, NaN payloads included.
#ifndef MPIDP_ELEMENTWISE_CUH
#define MPIDP_ELEMENTWISE_CUH

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define MPIDP_HD __host__ __device__ __forceinline__
#else
#define MPIDP_HD inline
#endif

namespace mpidp {

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Storage types: 16-bit floats are their bits, kept apart by tag.
struct f16 { u16 bits; };
struct bf16 { u16 bits; };

enum { OP_SUM = 0, OP_MIN = 1, OP_MAX = 2 };  // codes of mpidp/engine/dtypes.py and csrc/kernels.h

MPIDP_HD u32 float_bits(float x) { union { float f; u32 u; } v; v.f = x; return v.u; }
MPIDP_HD float bits_float(u32 u) { union { float f; u32 u; } v; v.u = u; return v.f; }

// ---- float16 <-> float (host: bit arithmetic; device: cvt) --------------------------------

MPIDP_HD float f16_to_float_soft(u16 h) {
    u32 sign = (u32)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        if (man == 0) return bits_float(sign);
        exp = 113;  // subnormal: normalise the mantissa
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        return bits_float(sign | (exp << 23) | ((man & 0x3ffu) << 13));
    }
    if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));
    return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

MPIDP_HD u16 float_to_f16_soft(float x) {
    const u32 inf32 = 255u << 23, max16 = (127u + 16u) << 23;
    const u32 denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    u32 f = float_bits(x), sign = f & 0x80000000u, o;
    f ^= sign;
    if (f >= max16) {
        o = (f > inf32) ? 0x7e00u : 0x7c00u;
    } else if (f < (113u << 23)) {  // subnormal or zero: the float adder rounds
        o = float_bits(bits_float(f) + bits_float(denorm_magic)) - denorm_magic;
    } else {  // normal: rebias, round to nearest even on the 13 dropped bits
        f += ((u32)(15 - 127) << 23) + 0xfffu + ((f >> 13) & 1u);
        o = f >> 13;
    }
    return (u16)(o | (sign >> 16));
}

MPIDP_HD float bf16_to_float(u16 b) { return bits_float((u32)b << 16); }

MPIDP_HD u16 float_to_bf16_soft(float x) {
    u32 u = float_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

#if defined(__CUDA_ARCH__)
// float arithmetic that keeps denormals whatever -ftz says (Note [Rounding like the host])
__device__ __forceinline__ float fadd(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float fmul(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float fdiv(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ bool fless(float a, float b) {
    unsigned r;
    asm("{ .reg .pred p; setp.lt.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(r) : "f"(a), "f"(b));
    return r != 0;
}
__device__ __forceinline__ bool fnan(float a) {  // a != a would compile to setp.*.ftz
    unsigned r;
    asm("{ .reg .pred p; setp.nan.f32 p, %1, %1; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a));
    return r != 0;
}
__device__ __forceinline__ float f16_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 float_to_f16(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ u16 float_to_bf16(float x) {
#if __CUDA_ARCH__ >= 800
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    return float_to_bf16_soft(x);  // cvt to bf16 came with sm_80
#endif
}
#else
inline float fadd(float a, float b) { return a + b; }
inline float fmul(float a, float b) { return a * b; }
inline float fdiv(float a, float b) { return a / b; }
inline bool fless(float a, float b) { return a < b; }
inline bool fnan(float a) { return a != a; }
inline float f16_to_float(u16 h) { return f16_to_float_soft(h); }
inline u16 float_to_f16(float x) { return float_to_f16_soft(x); }
inline u16 float_to_bf16(float x) { return float_to_bf16_soft(x); }
#endif

// ---- per dtype: the type it is combined in, load and store ------------------------------

template <typename T> struct Arith {  // float, double, int, long long: themselves
    typedef T type;
    static MPIDP_HD type load(T x) { return x; }
    static MPIDP_HD T store(type x) { return x; }
};
template <> struct Arith<f16> {
    typedef float type;
    static MPIDP_HD float load(f16 x) { return f16_to_float(x.bits); }
    static MPIDP_HD f16 store(float x) { f16 r; r.bits = float_to_f16(x); return r; }
};
template <> struct Arith<bf16> {
    typedef float type;
    static MPIDP_HD float load(bf16 x) { return bf16_to_float(x.bits); }
    static MPIDP_HD bf16 store(float x) { bf16 r; r.bits = float_to_bf16(x); return r; }
};

// Integer sums wrap (two's complement) as numpy's do: added unsigned, no overflow UB.
MPIDP_HD float add(float a, float b) { return fadd(a, b); }
MPIDP_HD double add(double a, double b) { return a + b; }
MPIDP_HD int add(int a, int b) { return (int)((u32)a + (u32)b); }
MPIDP_HD long long add(long long a, long long b) { return (long long)((u64)a + (u64)b); }

MPIDP_HD bool less(float a, float b) { return fless(a, b); }
MPIDP_HD bool less(double a, double b) { return a < b; }
MPIDP_HD bool less(int a, int b) { return a < b; }
MPIDP_HD bool less(long long a, long long b) { return a < b; }

MPIDP_HD bool is_nan(float a) { return fnan(a); }
MPIDP_HD bool is_nan(double a) { return a != a; }  // no .ftz for double
MPIDP_HD bool is_nan(int) { return false; }
MPIDP_HD bool is_nan(long long) { return false; }

// Whether min (max) of a and b is b (Note [NaN in min and max]): a is not NaN, and b is
// smaller (larger) or NaN. Integers: the plain compare (is_nan folds away).
template <int OP, typename A> MPIDP_HD bool takes_b(A a, A b) {
    return !is_nan(a) && ((OP == OP_MIN ? less(b, a) : less(a, b)) || is_nan(b));
}

template <int OP, typename A> MPIDP_HD A combine(A a, A b) {
    if (OP == OP_SUM) return add(a, b);
    return takes_b<OP>(a, b) ? b : a;
}

MPIDP_HD float product(float a, float b) { return fmul(a, b); }
MPIDP_HD double product(double a, double b) { return a * b; }
MPIDP_HD int product(int a, int b) { return (int)((u32)a * (u32)b); }
MPIDP_HD long long product(long long a, long long b) { return (long long)((u64)a * (u64)b); }
MPIDP_HD float quotient(float a, float b) { return fdiv(a, b); }
MPIDP_HD double quotient(double a, double b) { return a / b; }
MPIDP_HD int quotient(int a, int b) { return a / b; }  // never called: averages are floating
MPIDP_HD long long quotient(long long a, long long b) { return a / b; }

// The average's division (Note [Rounding like the host]); divisor >= 1, floating types only.
template <typename A> MPIDP_HD A divide(A x, long long divisor) {
    const A d = (A)divisor;
    return (divisor & (divisor - 1)) == 0 ? product(x, quotient((A)1, d)) : quotient(x, d);
}

// dst op src, then (divisor > 1) divided: the reduce-then-scale of one pass. min and max
// store the chosen operand as it is (Note [NaN in min and max]).
template <int OP, typename T> MPIDP_HD T reduce_one(T dst, T src, long long divisor) {
    typedef Arith<T> M;
    T r = OP == OP_SUM ? M::store(combine<OP>(M::load(dst), M::load(src)))
                       : (takes_b<OP>(M::load(dst), M::load(src)) ? src : dst);
    return divisor > 1 ? M::store(divide(M::load(r), divisor)) : r;
}

template <typename T> MPIDP_HD T divide_one(T x, long long divisor) {
    typedef Arith<T> M;
    return M::store(divide(M::load(x), divisor));
}

// Note [Casting buckets] (csrc/kernels.c): float32 into a 16-bit wire dtype W, divided in
// float32 first, rounded once; and back, widened, then divided.
template <typename W> MPIDP_HD W cast_in(float x, long long divisor) {
    return Arith<W>::store(divisor > 1 ? divide(x, divisor) : x);
}

template <typename W> MPIDP_HD float cast_out(W x, long long divisor) {
    const float wide = Arith<W>::load(x);
    return divisor > 1 ? divide(wide, divisor) : wide;
}

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// ---- device only: 16-byte vectors (Note [Vector loads] in reduce.cu) ----------------------

template <typename T> union Vec {
    uint4 raw;
    T lane[16 / sizeof(T)];
};

__device__ __forceinline__ bool aligned16(const void *a, const void *b) {
    return (((unsigned long long)a | (unsigned long long)b) & 15ull) == 0;
}

// out = f(a, b) element by element over count elements, as one grid-stride pass of the blocks
// along x, 16 bytes per load where the pointers are aligned (Note [Vector loads] in reduce.cu):
// the reductions and the division (reduce.cu) and a bucket's unpack with the average (pack.cu,
// one tensor per block row). F::inputs == 1: f reads a alone (b is not loaded).
template <typename T, typename F>
__device__ void map_vectors(T *out, const T *a, const T *b, long long count, F f) {
    const int lanes = 16 / sizeof(T);
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long vectors = aligned16(out, a) && aligned16(b, b) ? count / lanes : 0;
    uint4 *o4 = reinterpret_cast<uint4 *>(out);
    const uint4 *a4 = reinterpret_cast<const uint4 *>(a);
    const uint4 *b4 = reinterpret_cast<const uint4 *>(b);
    for (long long v = first; v < vectors; v += stride) {
        Vec<T> x, y;
        x.raw = a4[v];
        y.raw = F::inputs == 2 ? b4[v] : x.raw;
#pragma unroll
        for (int k = 0; k < lanes; k++) x.lane[k] = f(x.lane[k], y.lane[k]);
        o4[v] = x.raw;
    }
    for (long long i = vectors * lanes + first; i < count; i += stride)  // the tail
        out[i] = f(a[i], F::inputs == 2 ? b[i] : a[i]);
}

template <typename T, int OP> struct ReduceBy {  // dst op src, divided when divisor > 1
    long long divisor;
    static constexpr int inputs = 2;
    __device__ __forceinline__ T operator()(T dst, T src) const {
        return reduce_one<OP>(dst, src, divisor);
    }
};

template <typename T> struct DivideBy {
    long long divisor;
    static constexpr int inputs = 1;
    __device__ __forceinline__ T operator()(T x, T) const { return divide_one(x, divisor); }
};
#endif

}  // namespace mpidp

#endif
