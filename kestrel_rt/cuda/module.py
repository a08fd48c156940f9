"""Compile kernels/*.cu with cupy and launch them on torch's current CUDA stream.

One `KernelModules` per backend instance (no global cache): it compiles each source file
once, the first time one of its kernels is asked for, and launches on
`torch.cuda.current_stream()` wrapped as a cupy stream (Stream.from_external), so launches
interleave with torch ops and are recorded by `torch.cuda.graph` capture. Arguments are passed as numpy
scalars: tensors as their device address (`ptr`), so no DLPack round trip per launch.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import torch

from kernels import KERNEL_DIR, source
from kestrel_sim.errors import KestrelError

# cupy compiles for the current device's architecture (sm_90 on an H100/H200) by itself;
# an explicit -arch here would be passed to NVRTC twice.
OPTIONS = ("-std=c++17",)
INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)"[ \t]*$', re.MULTILINE)


def full_source(name: str) -> str:
    """kernels/NAME.cu with every `#include "X.cuh"` of kernels/ pasted in place (recursively,
    each header once).

    Inlining keeps cupy's on-disk kernel cache honest: its key is the source text, which then
    covers the headers too.
    """
    seen: set[str] = set()

    def paste(match: re.Match) -> str:
        header = match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        text = (KERNEL_DIR / header).read_text().replace("#pragma once\n", "")
        return INCLUDE.sub(paste, text)

    return INCLUDE.sub(paste, source(name))


MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute (cuda.h)


@functools.cache
def driver():
    """The CUDA driver library (for the function attributes cupy does not expose)."""
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


def ensure_dynamic_shared(fn, nbytes: int) -> None:
    """Let compiled kernel `fn` (a cupy Function or RawKernel) launch with at least `nbytes`
    of dynamic shared memory (above 48 KiB a kernel must ask for it). The attribute belongs
    to the function, which every backend of the process shares (cupy loads a source once),
    so it is read from the driver and only ever raised: one backend never lowers what
    another's launches, or its captured graphs, need."""
    import ctypes

    func = ctypes.c_void_p(getattr(fn, "kernel", fn).ptr)
    current = ctypes.c_int(0)
    err = driver().cuFuncGetAttribute(ctypes.byref(current), MAX_DYNAMIC_SHARED_SIZE_BYTES, func)
    if err == 0 and current.value >= nbytes:
        return
    err = driver().cuFuncSetAttribute(func, MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(nbytes))
    if err != 0:
        raise KestrelError(f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, {nbytes}) "
                           f"failed with CUresult {err}")


def ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a kernel argument (None -> null)."""
    return np.uint64(0 if t is None else t.data_ptr())


def i32(v: int) -> np.int32:
    return np.int32(v)


def i64(v: int) -> np.int64:
    return np.int64(v)


def f32(v: float) -> np.float32:
    return np.float32(v)


class _StreamHandle:
    """A raw CUDA stream handle speaking the CUDA stream protocol (`__cuda_stream__`)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


# Files whose every kernel runs pdl_wait() before touching activations (kernels/pdl.cuh):
# only these are launched with programmatic dependent launch.
PDL_FILES = frozenset({"rmsnorm", "swiglu", "moe", "decode_attention", "argmax"})


def current_stream(cupy, device_index: int, cache: dict):
    """torch's current stream of the device as a cupy stream (one wrapper per handle, kept in
    the caller's `cache`)."""
    handle = torch.cuda.current_stream(device_index).cuda_stream
    stream = cache.get(handle)
    if stream is None:
        try:  # cupy >= 14: the CUDA stream protocol
            stream = cupy.cuda.Stream.from_external(_StreamHandle(handle))
        except (AttributeError, TypeError, ValueError):  # older cupy
            stream = cupy.cuda.ExternalStream(handle, device_index)
        cache[handle] = stream
    return stream


class KernelModules:
    """The compiled kernels one backend uses, on one CUDA device.

    pdl: launch the kernels of PDL_FILES with programmatic dependent launch
    (kestrel_rt/cuda/pdl.py; needs compute capability >= 9.0, else ignored). defines: macros
    every file is compiled with (-DNAME), for diagnostic builds such as decode_attention.cu's
    DECODE_PROBE (bench/probes/attention_probe.py)."""

    def __init__(self, device: torch.device, pdl: bool = False,
                 defines: tuple[str, ...] = ()) -> None:
        try:
            import cupy
        except ImportError:
            raise KestrelError(
                "the cupy backend needs cupy: install kestrel with the 'cuda13' (or 'cuda12') "
                "extra, e.g. pip install -e '.[rt,cuda13]'"
            ) from None
        device = torch.device(device)
        if device.type != "cuda":
            raise KestrelError(f"the cupy backend runs on a CUDA device, not '{device}'")
        self._cupy = cupy
        self.options = OPTIONS + tuple(f"-D{d}" for d in defines)
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._modules: dict[str, object] = {}
        self._functions: dict[tuple[str, str], object] = {}
        self._streams: dict[int, object] = {}
        # device buffers kernels keep across launches (a captured graph holds their address),
        # by the caller's key, e.g. attention's arrival tickets
        self.workspaces: dict[object, torch.Tensor] = {}
        self.pdl = None
        if pdl and torch.cuda.get_device_capability(self.device_index) >= (9, 0):
            from kestrel_rt.cuda.pdl import Launcher

            self.pdl = Launcher()

    def module(self, file: str):
        """The compiled cupy RawModule of kernels/FILE.cu (compiled now if need be)."""
        self.compile_all((file,))
        return self._modules[file]

    def function(self, file: str, name: str):
        """Kernel `name` of kernels/FILE.cu, compiled on first use."""
        key = (file, name)
        fn = self._functions.get(key)
        if fn is None:
            self.compile_all((file,))
            fn = self._modules[file].get_function(name)
            self._functions[key] = fn
        return fn

    def _stream(self):
        return current_stream(self._cupy, self.device_index, self._streams)

    def launch(self, file: str, name: str, grid: tuple, block: tuple, args: tuple,
               shared_mem: int = 0) -> None:
        """Launch kernels/FILE.cu:NAME on torch's current stream of this device."""
        fn = self.function(file, name)
        if self.pdl is not None and file in PDL_FILES:
            handle = torch.cuda.current_stream(self.device_index).cuda_stream
            self.pdl(fn, grid, block, args, handle, shared_mem)
        elif self.device_index == 0:  # cupy's current device unless a caller changed it
            fn(grid, block, args, shared_mem=shared_mem, stream=self._stream())
        else:
            with self._cupy.cuda.Device(self.device_index):
                fn(grid, block, args, shared_mem=shared_mem, stream=self._stream())

    def compile_all(self, files: tuple[str, ...]) -> None:
        """Compile the given source files now (before a graph capture, say)."""
        for file in files:
            if file not in self._modules:
                with self._cupy.cuda.Device(self.device_index):
                    module = self._cupy.RawModule(code=full_source(file), options=self.options)
                    module.compile()
                self._modules[file] = module
