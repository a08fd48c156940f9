"""CUDA kernels from kernels/*.cu, compiled by cupy and launched on torch's current stream."""
