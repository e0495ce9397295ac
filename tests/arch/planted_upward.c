/* planted_upward.c: a core file that reaches up into the CPU backend. Built
 * with core's include path (the target fsdp_core_planted, never by
 * default), it must fail: engine/core sees only itself and the public
 * header (test arch.core_floor). */
#include "internal.h"
#include "cpu_kernels.h"

int planted_upward(void) { return cpu_threads_get(); }
