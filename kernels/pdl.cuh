// Programmatic dependent launch (Hopper+), see kestrel_rt/cuda/pdl.py.
//
// A kernel launched with PDL may start while the previous kernel on the stream finishes.
// pdl_trigger(): this block lets the next kernel launch (once every block of this grid has
//   triggered or exited); call it at the top of a kernel.
// pdl_wait(): block until the previous kernel has completed and its writes are visible.
//   Call it before reading anything an earlier kernel wrote and before writing anything an
//   earlier kernel may still read; only immutable data (weights) may be read before it.
// Both are no-ops when the kernel was launched without PDL or below sm_90.
#pragma once

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Where a gemv lets its dependents launch: at its top (default) or, compiled with
// -DGEMV_LATE_TRIGGER, after its K loop, so that the next kernels' blocks do not sit in
// the machine waiting while this one still streams its weights.
#ifdef GEMV_LATE_TRIGGER
#define GEMV_TRIGGER_TOP()
#define GEMV_TRIGGER_END() pdl_trigger()
#else
#define GEMV_TRIGGER_TOP() pdl_trigger()
#define GEMV_TRIGGER_END()
#endif
