"""Build the adapter for a configured backend: the one place that maps an engine kind to a class."""

from __future__ import annotations

from router.backends.base import Backend, BackendSpec
from router.backends.fetch import DEFAULT_TIMEOUT_S
from router.backends.sglang import SGLangBackend
from router.backends.vllm import VLLMBackend, VLLMExternalBackend


def make_backend(spec: BackendSpec, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Backend:
    """``timeout_s`` bounds every control-plane call (discovery, polls, aborts) to this backend."""
    if timeout_s <= 0:
        raise ValueError(f"backend timeout must be positive, got {timeout_s}")
    if spec.engine == "sglang":
        return SGLangBackend(spec, timeout_s=timeout_s)
    if spec.engine == "vllm":
        return VLLMBackend(spec, timeout_s=timeout_s)
    if spec.engine == "vllm-external":
        return VLLMExternalBackend(spec, timeout_s=timeout_s)
    raise ValueError(f"unknown engine {spec.engine!r}")
