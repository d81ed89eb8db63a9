"""Preparing the loaded model before it is compiled: weight quantization and the prepacked
LM head (the LM head runs outside the compiled graph)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from framework.core.config import CompilationConfig
from framework.core.quantization import QuantizationConfig
from passes.ops_prepack import PrepackedLinearMethod
from passes.quant_schemes import quantize_model


def quantize(model: torch.nn.Module, quantization: Any) -> tuple[Any, Optional[str], Any]:
    """Quantize ``model`` in place per ``quantization`` (a scheme name, dict or config);
    returns (the parsed config, its hash, the quantized layers), all None without one."""
    if quantization is None:
        return None, None, None

    qc = QuantizationConfig.parse(quantization)
    if qc is None:
        return None, None, None
    return qc, qc.compute_hash(), quantize_model(model, qc)


def prepack_lm_head(model: torch.nn.Module, config: CompilationConfig) -> None:
    """Give the LM head the prepacked path too when the ``prepack_linear`` pass is on (it is
    the largest matmul of a small model, and runs outside the compiled graph)."""
    head = getattr(model, "lm_head", None)
    if head is None or "prepack_linear" not in config.pass_config.passes:
        return

    if PrepackedLinearMethod.applies_to(head):
        head.linear_method = PrepackedLinearMethod()
