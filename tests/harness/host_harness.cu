// Host entry points to mpidp/engine/gpu/kernels/elementwise.cuh for tests/unit/test_gpu_kernels.py:
// the GPU kernels' element math, compiled for the host (nvcc, or a plain C++ compiler), callable
// from ctypes. Codes as mpidp/engine/dtypes.py.
#include "elementwise.cuh"

using namespace mpidp;

template <typename T>
static void reduce_typed(int op, void *dst, const void *src, long long n, long long divisor) {
    T *d = static_cast<T *>(dst);
    const T *s = static_cast<const T *>(src);
    for (long long i = 0; i < n; i++) {
        if (op == OP_SUM) d[i] = reduce_one<OP_SUM>(d[i], s[i], divisor);
        else if (op == OP_MIN) d[i] = reduce_one<OP_MIN>(d[i], s[i], divisor);
        else d[i] = reduce_one<OP_MAX>(d[i], s[i], divisor);
    }
}

template <typename T> static void divide_typed(void *buf, long long n, long long divisor) {
    T *b = static_cast<T *>(buf);
    for (long long i = 0; i < n; i++) b[i] = divide_one(b[i], divisor);
}

extern "C" int mpidp_host_reduce(int dtype, int op, void *dst, const void *src, long long n,
                                 long long divisor) {
    switch (dtype) {
    case 0: reduce_typed<f16>(op, dst, src, n, divisor); return 0;
    case 1: reduce_typed<bf16>(op, dst, src, n, divisor); return 0;
    case 2: reduce_typed<float>(op, dst, src, n, divisor); return 0;
    case 3: reduce_typed<double>(op, dst, src, n, divisor); return 0;
    case 4: reduce_typed<int>(op, dst, src, n, divisor); return 0;
    case 5: reduce_typed<long long>(op, dst, src, n, divisor); return 0;
    default: return -1;
    }
}

extern "C" int mpidp_host_divide(int dtype, void *buf, long long n, long long divisor) {
    switch (dtype) {
    case 0: divide_typed<f16>(buf, n, divisor); return 0;
    case 1: divide_typed<bf16>(buf, n, divisor); return 0;
    case 2: divide_typed<float>(buf, n, divisor); return 0;
    case 3: divide_typed<double>(buf, n, divisor); return 0;
    default: return -1;
    }
}

extern "C" void mpidp_host_f16_to_float(const u16 *in, float *out, long long n) {
    for (long long i = 0; i < n; i++) out[i] = f16_to_float(in[i]);
}

extern "C" void mpidp_host_float_to_f16(const float *in, u16 *out, long long n) {
    for (long long i = 0; i < n; i++) out[i] = float_to_f16(in[i]);
}

extern "C" void mpidp_host_bf16_to_float(const u16 *in, float *out, long long n) {
    for (long long i = 0; i < n; i++) out[i] = bf16_to_float(in[i]);
}

extern "C" void mpidp_host_float_to_bf16(const float *in, u16 *out, long long n) {
    for (long long i = 0; i < n; i++) out[i] = float_to_bf16(in[i]);
}

extern "C" int mpidp_host_cast(int wire, int unpack, u16 *bucket, float *values, long long n,
                               long long divisor) {
    for (long long i = 0; i < n; i++) {
        if (wire == 0) {
            f16 w; w.bits = bucket[i];
            if (unpack) values[i] = cast_out(w, divisor);
            else bucket[i] = cast_in<f16>(values[i], divisor).bits;
        } else if (wire == 1) {
            bf16 w; w.bits = bucket[i];
            if (unpack) values[i] = cast_out(w, divisor);
            else bucket[i] = cast_in<bf16>(values[i], divisor).bits;
        } else {
            return -1;
        }
    }
    return 0;
}
