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
// elements; a misaligned pair takes the scalar loop for everything. The loop itself,
// map_vectors, is in elementwise.cuh (shared with pack.cu).
#include "elementwise.cuh"

#define MPIDP_REDUCE(NAME, T, OPNAME, OP)                                                   \
    extern "C" __global__ void mpidp_reduce_##NAME##_##OPNAME(                             \
        T *dst, const T *src, long long count, long long divisor) {                        \
        mpidp::map_vectors(dst, dst, src, count, mpidp::ReduceBy<T, mpidp::OP>{divisor});  \
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
        mpidp::map_vectors(buf, buf, buf, count, mpidp::DivideBy<T>{divisor});             \
    }
MPIDP_DIVIDE(f16, mpidp::f16)
MPIDP_DIVIDE(bf16, mpidp::bf16)
MPIDP_DIVIDE(f32, float)
MPIDP_DIVIDE(f64, double)
