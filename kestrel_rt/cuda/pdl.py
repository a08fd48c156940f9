"""Programmatic dependent launch (PDL, Hopper and later): let a kernel start while the
previous kernel on the stream is finishing.

    launch(fn, grid, block, args, stream_handle, shared_mem=0)

`fn` is a compiled cupy kernel (a RawKernel: its CUfunction is `fn.kernel.ptr`), `args` the numpy scalars cupy
takes (np.uint64 pointers, np.int32 / np.int64 / np.float32). The launch goes through the
driver's cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, so the
kernel's blocks may be scheduled as soon as every block of the previous kernel has run
`griddepcontrol.launch_dependents` (kernels/pdl.cuh: pdl_trigger). Correctness rests on the
kernel: it must run `griddepcontrol.wait` (pdl_wait) before it reads anything an earlier
kernel wrote or writes anything an earlier kernel reads; only immutable data (weights) may be
read before. Launches are recorded by stream capture like any other (CUDA >= 12.3 keeps the
programmatic edge in the graph).
"""

from __future__ import annotations

import ctypes

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)
_CTYPE = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.int32: ctypes.c_int32,
          np.float32: ctypes.c_float}


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_pad", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def _dims(d: tuple) -> tuple[int, int, int]:
    d = tuple(int(v) for v in d)
    return (d + (1, 1, 1))[:3]


def kernel_params(args: tuple) -> tuple[ctypes.Array, list]:
    """The void* array cuLaunchKernelEx takes, and the ctypes values it points at (keep them
    alive until the launch returns)."""
    values = []
    for a in args:
        ctype = _CTYPE.get(type(a))
        if ctype is None:
            raise TypeError(f"kernel argument {a!r} of type {type(a).__name__}: expected one of "
                            f"{sorted(t.__name__ for t in _CTYPE)}")
        values.append(ctype(a.item()))
    params = (ctypes.c_void_p * max(1, len(values)))(
        *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    return params, values


def config(grid: tuple, block: tuple, stream_handle: int, shared_mem: int,
           attr: LaunchAttribute) -> LaunchConfig:
    g, b = _dims(grid), _dims(block)
    return LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, stream_handle,
                        ctypes.pointer(attr), 1)


class Launcher:
    """cuLaunchKernelEx with the programmatic-serialization attribute (one per backend)."""

    def __init__(self) -> None:
        self._driver = ctypes.CDLL("libcuda.so.1")
        self._launch = self._driver.cuLaunchKernelEx
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p]
        self._attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)

    def __call__(self, fn, grid: tuple, block: tuple, args: tuple, stream_handle: int,
                 shared_mem: int = 0) -> None:
        cfg = config(grid, block, stream_handle, shared_mem, self._attr)
        params, _values = kernel_params(args)
        func = getattr(fn, "kernel", fn).ptr  # a RawKernel's compiled Function, or a Function
        err = self._launch(ctypes.byref(cfg), ctypes.c_void_p(func), params, None)
        if err != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err} (grid {grid}, "
                               f"block {block}, shared memory {shared_mem} bytes)")
