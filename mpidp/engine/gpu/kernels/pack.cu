// Multi-tensor pack and unpack of a bucket (the GPU twin of csrc/fusion.c): one launch moves
// many tensors between their own memory and one flat bucket, from device arrays of pointers,
// bucket offsets and sizes. Block (x, t) works on tensor t; blocks along x stride through it.
//   mpidp_copy_bytes(char *bucket, const unsigned long long *tensors,
//                    const long long *offsets_bytes, const long long *sizes_bytes, int unpack)
//   mpidp_unpack_divide_<dtype>(const T *bucket, const unsigned long long *tensors,
//                    const long long *offsets, const long long *counts, long long divisor)
//   mpidp_cast_<wire>(W *bucket, const unsigned long long *tensors, const long long *offsets,
//                    const long long *counts, long long divisor, int unpack)
// The copy moves the widest unit (16, 8, 4, 2 or 1 bytes) that divides both addresses and the
// size; unpack_divide writes bucket / divisor (the average's division, elementwise.cuh, 16
// bytes per load where the tensor and its slot are aligned);
// cast packs float32 tensors into a float16/bfloat16 bucket or unpacks them back, divided on
// the way (Note [Casting buckets] in csrc/kernels.c).
#include "elementwise.cuh"

namespace mpidp {

template <typename U>
__device__ void copy_units(char *to, const char *from, long long units) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    U *t = reinterpret_cast<U *>(to);
    const U *f = reinterpret_cast<const U *>(from);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < units; i += stride)
        t[i] = f[i];
}

}  // namespace mpidp

extern "C" __global__ void mpidp_copy_bytes(char *bucket, const unsigned long long *tensors,
                                            const long long *offsets_bytes,
                                            const long long *sizes_bytes, int unpack) {
    const int t = blockIdx.y;
    char *mine = reinterpret_cast<char *>(tensors[t]);
    char *slot = bucket + offsets_bytes[t];
    const long long size = sizes_bytes[t];
    char *to = unpack ? mine : slot;
    const char *from = unpack ? slot : mine;
    const unsigned long long bits = (unsigned long long)to | (unsigned long long)from |
                                    (unsigned long long)size;
    if ((bits & 15ull) == 0) mpidp::copy_units<uint4>(to, from, size / 16);
    else if ((bits & 7ull) == 0) mpidp::copy_units<unsigned long long>(to, from, size / 8);
    else if ((bits & 3ull) == 0) mpidp::copy_units<unsigned int>(to, from, size / 4);
    else if ((bits & 1ull) == 0) mpidp::copy_units<unsigned short>(to, from, size / 2);
    else mpidp::copy_units<unsigned char>(to, from, size);
}

#define MPIDP_UNPACK_DIVIDE(NAME, T)                                                        \
    extern "C" __global__ void mpidp_unpack_divide_##NAME(                                 \
        const T *bucket, const unsigned long long *tensors, const long long *offsets,      \
        const long long *counts, long long divisor) {                                      \
        const int t = blockIdx.y;                                                           \
        const T *slot = bucket + offsets[t];                                                \
        mpidp::map_vectors(reinterpret_cast<T *>(tensors[t]), slot, slot, counts[t],        \
                           mpidp::DivideBy<T>{divisor});                                    \
    }
MPIDP_UNPACK_DIVIDE(f16, mpidp::f16)
MPIDP_UNPACK_DIVIDE(bf16, mpidp::bf16)
MPIDP_UNPACK_DIVIDE(f32, float)
MPIDP_UNPACK_DIVIDE(f64, double)

#define MPIDP_CAST(NAME, W)                                                                 \
    extern "C" __global__ void mpidp_cast_##NAME(                                          \
        W *bucket, const unsigned long long *tensors, const long long *offsets,            \
        const long long *counts, long long divisor, int unpack) {                          \
        const int t = blockIdx.y;                                                           \
        float *mine = reinterpret_cast<float *>(tensors[t]);                                \
        W *slot = bucket + offsets[t];                                                      \
        const long long stride = (long long)gridDim.x * blockDim.x;                        \
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < counts[t]; \
             i += stride) {                                                                 \
            if (unpack) mine[i] = mpidp::cast_out(slot[i], divisor);                        \
            else slot[i] = mpidp::cast_in<W>(mine[i], divisor);                             \
        }                                                                                   \
    }
MPIDP_CAST(f16, mpidp::f16)
MPIDP_CAST(bf16, mpidp::bf16)
