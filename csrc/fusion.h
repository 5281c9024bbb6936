/* Bucket fusion on host memory: many buffers packed back to back into one flat bucket, and
 * the bucket unpacked into them again with the average's division fused into the copy.
 * Pure C, no Python (bindings in module.c). */
#ifndef MPIDP_FUSION_H
#define MPIDP_FUSION_H
#include <stddef.h>

typedef struct {
    char *ptr;
    size_t nbytes;
} mp_segment;

/* Copies segs[0..n) into bucket back to back; returns the bytes written. */
size_t mp_pack(char *bucket, const mp_segment *segs, size_t n);
/* Copies bucket back into segs[0..n), dividing by divisor on the way when divisor > 1
 * (floating dtypes only; one pass). Returns -1 on a bad dtype, else 0. */
int mp_unpack(const char *bucket, const mp_segment *segs, size_t n, int dtype, long divisor);
/* pack and unpack between buffers of dtype `outer` (segs) and a bucket of dtype `wire`,
 * converted (float32 <-> float16/bfloat16) and divided by divisor in the same pass: `unpack`
 * true reads the bucket into segs, false packs segs into the bucket. Returns -1 on a pair
 * mp_cast_into does not convert, else 0. */
int mp_cast_segments(char *bucket, int wire, const mp_segment *segs, size_t n, int outer,
                     long divisor, int unpack);

#endif
