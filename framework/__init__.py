"""piecewise framework: configs, forward context, compile wrapper, artifact cache, CUDA-graph
wrapper and dispatcher, runner and the ``LLM`` entry point.

Exports are lazy so that leaf modules (``framework.forward_context``, ``framework.config``)
can be imported by ``backends``/``models`` without pulling in the runner.
"""
from typing import Any

_EXPORTS = {
    "LLM": "framework.llm",
    "CompilationConfig": "framework.config",
    "PassConfig": "framework.config",
    "CompilationMode": "framework.config",
    "CUDAGraphMode": "framework.forward_context",
    "BatchDescriptor": "framework.forward_context",
    "ForwardContext": "framework.forward_context",
    "set_forward_context": "framework.forward_context",
    "get_forward_context": "framework.forward_context",
    "QuantizationConfig": "framework.quantization",
    "SamplingParams": "framework.sampling_params",
    "RequestOutput": "framework.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'framework' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_EXPORTS[name]), name)
