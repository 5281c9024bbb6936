/* Element-wise reduction kernels on host memory: every dtype mpidp accepts, sum/min/max,
 * and the divide that turns a sum into an average. Pure C, no Python: shared by the
 * Python bindings (module.c) and the shared-memory protocol (shm.c). */
#ifndef MPIDP_KERNELS_H
#define MPIDP_KERNELS_H
#include <stddef.h>
#include <stdint.h>

/* Codes shared with mpidp/engine/dtypes.py (DTYPE_CODES, OP_CODES). */
enum { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2, DT_F64 = 3, DT_I32 = 4, DT_I64 = 5, DT_COUNT = 6 };
enum { OP_SUM = 0, OP_MIN = 1, OP_MAX = 2, OP_COUNT = 3 };

size_t mp_itemsize(int dtype);
/* dst[i] = a[i] op b[i]; dst may alias a or b. Returns -1 on a bad code. */
int mp_reduce2(void *dst, const void *a, const void *b, size_t count, int dtype, int op);
/* dst[i] = src[i] / divisor for floating dtypes (dst may alias src; float16 and bfloat16
 * through float32, rounded to nearest even). Returns -1 on an integer or bad dtype. */
int mp_divide_into(void *dst, const void *src, size_t count, int dtype, long divisor);
/* mp_divide_into(buf, buf, ...). */
int mp_divide(void *buf, size_t count, int dtype, long divisor);
/* dst[i] = src[i] / divisor converted between float32 and float16 or bfloat16 (either way;
 * Note [Casting buckets] in kernels.c). Returns -1 on another pair or a divisor < 1. */
int mp_cast_into(void *dst, int dst_dtype, const void *src, int src_dtype, size_t count,
                 long divisor);
/* memcpy(dst, src, n) with non-temporal stores where the CPU has them (x86-64: SSE2's
 * movntdq): the destination is written without being read first (Note [Streaming copy]). */
void mp_stream_copy(void *dst, const void *src, size_t n);

#endif
