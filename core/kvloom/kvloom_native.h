/* Helpers shared by the C kernels of kvloom's CPU plugins. kvloom.native compiles every
 * plugin's C source with this header's folder on the include path (and rebuilds when the
 * header changes): `#include "kvloom_native.h"`. */
#ifndef KVLOOM_NATIVE_H
#define KVLOOM_NATIVE_H

#include <stdint.h>
#include <stdlib.h>

/* The calling thread's scratch buffer, at least `bytes` long: grown as needed and kept for
 * the next call (a kernel's call runs on one thread at a time; each thread has its own, and
 * each library that includes this its own). NULL without memory. */
static __thread void *kvloom_scratch;
static __thread int64_t kvloom_scratch_bytes;

static inline void *thread_scratch(int64_t bytes)
{
    if (bytes > kvloom_scratch_bytes) {
        void *grown = realloc(kvloom_scratch, (size_t)bytes);
        if (grown == NULL) return NULL;
        kvloom_scratch = grown;
        kvloom_scratch_bytes = bytes;
    }
    return kvloom_scratch;
}

#endif
