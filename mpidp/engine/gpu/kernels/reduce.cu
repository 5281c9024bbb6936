// Reduction kernels of the GPU array seam (mpidp/engine/gpu/ops.py): dst = dst op src over flat
// buffers, the average's division fused into the same pass, and a plain in-place division.
// One entry point per (dtype, op), extern "C" so CuPy finds them by name:
//   mpidp_reduce_<dtype>_<op>(T *dst, const T *src, long long count, long long divisor)
//   mpidp_divide_<dtype>(T *buf, long long count, long long divisor)
// dtype: f16 bf16 f32 f64 i32 i64; op: sum min max. Element math: elementwise.cuh.
//
// Note [Vector loads]: where both pointers are 16-byte aligned (CuPy's allocations are, and so
// are slices at multiples of 16 bytes) every thread moves 16 bytes per load with uint4, a
// grid-stride loop covers the vectors, and a scalar tail loop the last count % (16 / size)
// elements; a misaligned pair takes the scalar loop for everything.
#include "elementwise.cuh"

namespace mpidp {

template <typename T> union Vec {
    uint4 raw;
    T lane[16 / sizeof(T)];
};

__device__ __forceinline__ bool aligned16(const void *a, const void *b) {
    return (((unsigned long long)a | (unsigned long long)b) & 15ull) == 0;
}

template <typename T, int OP>
__device__ void reduce_kernel(T *dst, const T *src, long long count, long long divisor) {
    const int lanes = 16 / sizeof(T);
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long vectors = aligned16(dst, src) ? count / lanes : 0;
    uint4 *d4 = reinterpret_cast<uint4 *>(dst);
    const uint4 *s4 = reinterpret_cast<const uint4 *>(src);
    for (long long v = first; v < vectors; v += stride) {
        Vec<T> a, b;
        a.raw = d4[v];
        b.raw = s4[v];
#pragma unroll
        for (int k = 0; k < lanes; k++) a.lane[k] = reduce_one<OP>(a.lane[k], b.lane[k], divisor);
        d4[v] = a.raw;
    }
    for (long long i = vectors * lanes + first; i < count; i += stride)  // the tail
        dst[i] = reduce_one<OP>(dst[i], src[i], divisor);
}

template <typename T>
__device__ void divide_kernel(T *buf, long long count, long long divisor) {
    const int lanes = 16 / sizeof(T);
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long vectors = aligned16(buf, buf) ? count / lanes : 0;
    uint4 *b4 = reinterpret_cast<uint4 *>(buf);
    for (long long v = first; v < vectors; v += stride) {
        Vec<T> a;
        a.raw = b4[v];
#pragma unroll
        for (int k = 0; k < lanes; k++) a.lane[k] = divide_one(a.lane[k], divisor);
        b4[v] = a.raw;
    }
    for (long long i = vectors * lanes + first; i < count; i += stride)
        buf[i] = divide_one(buf[i], divisor);
}

}  // namespace mpidp

#define MPIDP_REDUCE(NAME, T, OPNAME, OP)                                                   \
    extern "C" __global__ void mpidp_reduce_##NAME##_##OPNAME(                             \
        T *dst, const T *src, long long count, long long divisor) {                        \
        mpidp::reduce_kernel<T, mpidp::OP>(dst, src, count, divisor);                      \
    }
#define MPIDP_DTYPE(NAME, T)                                                                \
    MPIDP_REDUCE(NAME, T, sum, OP_SUM)                                                      \
    MPIDP_REDUCE(NAME, T, min, OP_MIN)                                                      \
    MPIDP_REDUCE(NAME, T, max, OP_MAX)

MPIDP_DTYPE(f16, mpidp::f16)
MPIDP_DTYPE(bf16, mpidp::bf16)
MPIDP_DTYPE(f32, float)
MPIDP_DTYPE(f64, double)
MPIDP_DTYPE(i32, int)
MPIDP_DTYPE(i64, long long)

#define MPIDP_DIVIDE(NAME, T)                                                               \
    extern "C" __global__ void mpidp_divide_##NAME(T *buf, long long count,                \
                                                    long long divisor) {                   \
        mpidp::divide_kernel<T>(buf, count, divisor);                                      \
    }
MPIDP_DIVIDE(f16, mpidp::f16)
MPIDP_DIVIDE(bf16, mpidp::bf16)
MPIDP_DIVIDE(f32, float)
MPIDP_DIVIDE(f64, double)
