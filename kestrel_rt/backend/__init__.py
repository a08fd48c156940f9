"""Backends: where and how one model's ops run. See base.py for the interface."""

from kestrel_rt.backend.base import Backend, BackendInUseError
from kestrel_rt.backend.torch_backend import TorchBackend

__all__ = ["Backend", "BackendInUseError", "TorchBackend"]
