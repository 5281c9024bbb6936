/* Bucket fusion: pack and unpack (see fusion.h). */
#include <string.h>
#include "fusion.h"
#include "kernels.h"

size_t mp_pack(char *bucket, const mp_segment *segs, size_t n) {
    size_t offset = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(bucket + offset, segs[i].ptr, segs[i].nbytes);
        offset += segs[i].nbytes;
    }
    return offset;
}

int mp_unpack(const char *bucket, const mp_segment *segs, size_t n, int dtype, long divisor) {
    size_t isz = mp_itemsize(dtype), offset = 0;
    if (!isz) return -1;
    for (size_t i = 0; i < n; i++) {
        if (divisor > 1) {
            if (mp_divide_into(segs[i].ptr, bucket + offset, segs[i].nbytes / isz, dtype,
                               divisor) < 0)
                return -1;
        } else {
            memcpy(segs[i].ptr, bucket + offset, segs[i].nbytes);
        }
        offset += segs[i].nbytes;
    }
    return 0;
}

int mp_cast_segments(char *bucket, int wire, const mp_segment *segs, size_t n, int outer,
                     long divisor, int unpack) {
    size_t wsz = mp_itemsize(wire), osz = mp_itemsize(outer), offset = 0;
    if (!wsz || !osz) return -1;
    for (size_t i = 0; i < n; i++) {
        size_t count = segs[i].nbytes / osz;
        int err = unpack ? mp_cast_into(segs[i].ptr, outer, bucket + offset, wire, count, divisor)
                         : mp_cast_into(bucket + offset, wire, segs[i].ptr, outer, count, divisor);
        if (err < 0) return -1;
        offset += count * wsz;
    }
    return 0;
}
