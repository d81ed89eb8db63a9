"""piecewise framework: configs, forward context, compile wrapper, artifact cache, CUDA-graph
wrapper and dispatcher, runner and the ``LLM`` entry point.

Exports are lazy so that leaf modules (``framework.core.forward_context``, ``framework.core.config``)
can be imported by ``backends``/``models`` without pulling in the runner.
"""
from typing import Any

_EXPORTS = {
    "LLM": "framework.engine.llm",
    "CompilationConfig": "framework.core.config",
    "PassConfig": "framework.core.config",
    "CompilationMode": "framework.core.config",
    "CUDAGraphMode": "framework.core.forward_context",
    "BatchDescriptor": "framework.core.forward_context",
    "ForwardContext": "framework.core.forward_context",
    "set_forward_context": "framework.core.forward_context",
    "get_forward_context": "framework.core.forward_context",
    "QuantizationConfig": "framework.core.quantization",
    "SamplingParams": "framework.engine.sampling_params",
    "RequestOutput": "framework.engine.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'framework' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_EXPORTS[name]), name)
