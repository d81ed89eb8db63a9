"""Fused custom ops (namespace ``piecewise``) used by the fusion and quantization passes.

Importing this package registers every op below with ``torch.library``; it never imports
Triton (GPU kernels are bound lazily on first CUDA call, see :mod:`framework.core.ops`).

Signatures (mutated arguments marked ``!``; ops return ``None`` unless a return is shown).
Quantized outputs are ``torch.int8`` or ``torch.float8_e4m3fn`` (chosen by ``out.dtype``);
scales are fp32, static ``[1]``, dynamic per-token ``[T, 1]``.

    piecewise::rms_norm(out!, x, weight, eps: float)
    piecewise::fused_add_rms_norm(x!, residual!, weight, eps: float)
        residual <- x + residual ; x <- rms_norm(residual) * weight
    piecewise::rms_norm_static_quant(out!, x, weight, scale, eps: float)
    piecewise::fused_add_rms_norm_static_quant(out!, x, residual!, weight, scale, eps: float)
    piecewise::rms_norm_dynamic_quant(out!, x, weight, scales!, eps: float,
                                      residual!: Optional[Tensor])
    piecewise::static_scaled_quant(out!, x, scale)
    piecewise::dynamic_per_token_quant(out!, x, scales!)
    piecewise::silu_and_mul(out!, x)                      x [T, 2I] -> out [T, I]
    piecewise::silu_and_mul_static_quant(out!, x, scale)
    piecewise::silu_and_mul_dynamic_quant(out!, x, scales!)
    piecewise::qk_norm_rope(qkv!, positions, q_weight, k_weight, cos_sin_cache,
                            num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                            is_neox: bool)
    piecewise::int8_scaled_mm(x_q, x_scale, w_q, w_scale, bias: Optional, out_dtype) -> Tensor
    piecewise::fp8_scaled_mm(x_q, x_scale, w_q, w_scale, bias: Optional, out_dtype) -> Tensor
        x_q [T, K]; w_q [K, N] any strides (pass weight[N, K].t()); x_scale [T,1] or [1];
        w_scale [1, N] or [1]; result [T, N] of out_dtype
    piecewise::int8_weight_only_mm(x, w_q, w_scale, bias: Optional) -> Tensor
        (addition) x [T, K] float; w_q [N, K] int8 (Linear layout); w_scale [N]; result x.dtype

    piecewise::topk_softmax(logits, top_k: int, renormalize: bool) -> (weights, ids)
    piecewise::fused_moe(x, topk_weights, topk_ids, w13, w2) -> Tensor
    piecewise::fused_moe_int8(x, topk_weights, topk_ids, w13_q, w13_scale, w2_q, w2_scale,
                              quantize_activations: bool) -> Tensor
        mixture of experts (see :mod:`passes.ops.moe` for shapes and arithmetic); the bf16
        experts re-laid out for the small-M kernel run ``piecewise::fused_moe_packed``
        (:mod:`passes.ops.packed_moe`, beside ``piecewise::packed_linear``)

Arithmetic (rounding, clamping, minimum dynamic scale): :mod:`passes.ops.quant_utils`.
Plain-torch implementations ``<op>_torch`` live next to each op (CPU path and test oracle);
Triton kernels live in :mod:`passes.ops.triton` (GPU path).
"""

from passes.ops import (  # noqa: F401  (registers)
    activation,
    activation_quant,
    moe,
    norm,
    rope,
    scaled_mm,
)
