"""piecewise framework, in layers (the README's "Layers"): ``core`` (configs, forward context,
registry and op helpers), ``compile`` + ``cache`` + ``cudagraph`` (the compile spine) and
``engine`` (``LLM``, runner, scheduler, KV cache, sampler).

Every layer imports ``framework.core``, which runs this ``__init__`` first; so the exports
below are resolved on first use (PEP 562) instead of importing the engine here, which would
make importing the base layer import the whole stack (and Dynamo).
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
    "SpeculativeConfig": "framework.engine.spec.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'framework' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
