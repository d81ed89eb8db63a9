"""A GGUF file for llama.cpp from a Hugging Face Llama or Qwen3-MoE checkpoint folder
(safetensors), so llama.cpp runs the very weights the project runs (``experiments.bench.peers``,
``experiments.bench.moe``).

    python -m experiments.bench.gguf_writer MODEL_DIR OUT.gguf [--type bf16|q8_0]

Written with the ``gguf`` package (the optional extra ``peers``), streamed tensor by tensor:
the tensor infos first (from the safetensors headers), then each tensor's bytes, so at most one
tensor is in memory (a stacked expert tensor: its parts and the stack).

The layout llama.cpp's ``llama`` architecture expects:

- tensor names ``token_embd``, ``blk.N.attn_norm`` / ``attn_q`` / ``attn_k`` / ``attn_v`` /
  ``attn_output`` / ``ffn_norm`` / ``ffn_gate`` / ``ffn_up`` / ``ffn_down``, ``output_norm``,
  ``output`` (absent with tied embeddings: llama.cpp then reads ``token_embd``);
- **q and k projections permuted**: Hugging Face's rotary embedding rotates the pairs
  ``(j, j + d/2)`` of each head, llama.cpp's (``LLAMA_ROPE_TYPE_NORM``) the adjacent pairs
  ``(2j, 2j + 1)``.  Rows of each head's block of q (and k, per KV head) are reordered so that
  row ``2j`` is HF row ``j`` and row ``2j + 1`` is HF row ``j + d/2`` (:func:`permute_qk`;
  :func:`unpermute_qk` is its inverse).  With that, llama.cpp's rope on the permuted
  projection is the permutation of HF's rope on the original one (tested);
- 1-D tensors (norm weights, biases) in F32; 2-D weights in BF16 (the checkpoint's bits, or
  fp32 rounded to nearest even as torch does) or Q8_0 (blocks of 32 along the input dimension,
  one fp16 scale each, quantized by ``gguf.quants`` from the fp32 values);
- Qwen3-MoE (llama.cpp's ``qwen3moe``, see :func:`tensor_plan`): no q/k permutation (NeoX rope),
  ``attn_q_norm`` / ``attn_k_norm``, the router ``ffn_gate_inp`` (F32, as llama.cpp's converter
  keeps it), the experts stacked per projection ``ffn_{gate,up,down}_exps`` ``[E, out, in]``;
  keys ``qwen3moe.expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length``,
  ``attention.key_length`` / ``value_length`` (the head dimension);
- hyper-parameters under ``<arch>.*``; a placeholder SentencePiece-style vocabulary of
  ``vocab_size`` tokens (``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens, then ``tN``): the
  benchmark feeds token ids, so only the count and the special ids matter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch

TYPES = ("bf16", "q8_0")


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half row order -> llama.cpp's interleaved one, per head (``[n_heads * d, ...]``;
    ``n_heads`` is the KV head count for k)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"permute_qk: {rows} rows do not split into {n_heads} heads of pairs")
    return (
        w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`permute_qk`."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def _safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"gguf_writer: no *.safetensors in {model_dir}")
    return files


def _tensor_index(model_dir: Path) -> dict[str, tuple[Path, list[int]]]:
    """name -> (file, shape), from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    out: dict[str, tuple[Path, list[int]]] = {}
    for f in _safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                out[name] = (f, list(st.get_slice(name).get_shape()))
    return out


ARCHS = {"llama": "llama", "qwen3_moe": "qwen3moe"}
"""HF ``model_type`` -> the llama.cpp architecture written."""

Source = Union[str, tuple[str, ...]]
"""The HF tensor(s) of one GGUF tensor: one name, or the per-expert names stacked in order."""


def _n_experts(config: dict[str, Any]) -> int:
    """Experts per MoE layer (``num_experts``; transformers 5 writes ``num_local_experts``)."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def _moe_layers(config: dict[str, Any]) -> list[int]:
    """The MoE layers of a Qwen3-MoE config (``mlp_only_layers``, ``decoder_sparse_step``)."""
    step = config.get("decoder_sparse_step", 1) or 1
    dense = set(config.get("mlp_only_layers") or [])
    return [
        i
        for i in range(config["num_hidden_layers"])
        if _n_experts(config) > 0 and i not in dense and (i + 1) % step == 0
    ]


def tensor_plan(config: dict[str, Any], names: set[str]) -> list[tuple[str, Source, str]]:
    """(GGUF name, HF name(s), q/k permutation: "q", "k" or "") for every tensor, in file order.

    Llama: q and k permuted (llama.cpp's interleaved rope).  Qwen3-MoE (``qwen3moe``):
    nothing permuted (llama.cpp runs Qwen's rotate-half rope, NeoX style), the per-head q/k
    norms as ``attn_q_norm`` / ``attn_k_norm``, the router as ``ffn_gate_inp`` and each of the
    experts' gate, up and down projections stacked over the experts (``[E, out, in]``, expert
    order) as ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, as llama.cpp's
    converter writes them.  llama.cpp's ``qwen3moe`` has no dense layers: a checkpoint with
    ``mlp_only_layers`` or ``decoder_sparse_step`` > 1 is refused."""
    model_type = config.get("model_type")
    moe = model_type == "qwen3_moe"
    perm_q, perm_k = ("", "") if moe else ("q", "k")
    plan: list[tuple[str, Source, str]] = [("token_embd.weight", "model.embed_tokens.weight", "")]
    per_layer = [
        ("attn_norm", "input_layernorm", ""),
        ("attn_q", "self_attn.q_proj", perm_q),
        ("attn_k", "self_attn.k_proj", perm_k),
        ("attn_v", "self_attn.v_proj", ""),
        ("attn_output", "self_attn.o_proj", ""),
        ("attn_q_norm", "self_attn.q_norm", ""),
        ("attn_k_norm", "self_attn.k_norm", ""),
        ("ffn_norm", "post_attention_layernorm", ""),
    ]
    if moe:
        layers = _moe_layers(config)
        if layers != list(range(config["num_hidden_layers"])):
            dense = sorted(set(range(config["num_hidden_layers"])) - set(layers))
            raise ValueError(
                f"gguf_writer: llama.cpp's qwen3moe has no dense layers; layers {dense} are "
                f"dense (mlp_only_layers / decoder_sparse_step)"
            )
        per_layer.append(("ffn_gate_inp", "mlp.gate", ""))
    else:
        per_layer += [
            ("ffn_gate", "mlp.gate_proj", ""),
            ("ffn_up", "mlp.up_proj", ""),
            ("ffn_down", "mlp.down_proj", ""),
        ]
    for i in range(config["num_hidden_layers"]):
        for g, h, perm in per_layer:
            for suffix in ("weight", "bias"):
                hf = f"model.layers.{i}.{h}.{suffix}"
                if hf in names:
                    plan.append((f"blk.{i}.{g}.{suffix}", hf, perm))
        if moe:
            for g, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                stack = tuple(
                    f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"
                    for e in range(_n_experts(config))
                )
                plan.append((f"blk.{i}.ffn_{g}_exps.weight", stack, ""))
    plan.append(("output_norm.weight", "model.norm.weight", ""))
    if "lm_head.weight" in names and not config.get("tie_word_embeddings", False):
        plan.append(("output.weight", "lm_head.weight", ""))
    missing = [hf for _, src, _ in plan for hf in _sources(src) if hf not in names]
    if missing:
        raise KeyError(f"gguf_writer: the checkpoint lacks {missing[:4]}")
    return plan


def _sources(src: Source) -> tuple[str, ...]:
    return (src,) if isinstance(src, str) else src


def _vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    if n < len(tokens):
        tokens, types = [f"t{i}" for i in range(n)], [TokenType.NORMAL] * n
        types[:3] = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL][: min(3, n)]
    tokens += [f"t{i}" for i in range(len(tokens), n)]
    types += [TokenType.NORMAL] * (n - len(types))
    return tokens, [0.0] * n, [int(t) for t in types]


def _data(t: torch.Tensor, kind: str) -> tuple[Any, Any]:
    """(numpy array to write, GGML type) of one tensor; ``kind`` "f32", "bf16" or "q8_0"
    (1-D tensors are F32 whatever the kind)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if t.dim() == 1 or kind == "f32":
        return t.to(torch.float32).numpy(), Q.F32
    if kind == "bf16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view("uint16"), Q.BF16
    if t.shape[-1] % 32:
        raise ValueError(f"gguf_writer: q8_0 needs rows of a multiple of 32, got {tuple(t.shape)}")
    return quants.quantize(t.to(torch.float32).numpy(), Q.Q8_0), Q.Q8_0


def _nbytes(shape: list[int], ggml_type: Any) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[ggml_type]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def write_gguf(model_dir: str | Path, out: str | Path, kind: str = "bf16") -> Path:
    """Write ``out`` (via a temp name, renamed) from ``model_dir``; returns ``out``."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, LlamaFileType
    from safetensors import safe_open

    if kind not in TYPES:
        raise ValueError(f"gguf_writer: type must be one of {TYPES}, got {kind!r}")
    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    arch = ARCHS.get(config.get("model_type"))
    if arch is None:
        raise ValueError(
            f"gguf_writer: writes {sorted(ARCHS)} checkpoints, got {config.get('model_type')}"
        )
    index = _tensor_index(model_dir)
    plan = tensor_plan(config, set(index))
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // n_heads

    tmp = out.with_name(f".{out.name}.tmp")
    w = GGUFWriter(str(tmp), arch)
    w.add_name(model_dir.name)
    w.add_file_type(LlamaFileType.MOSTLY_BF16 if kind == "bf16" else LlamaFileType.MOSTLY_Q8_0)
    if kind == "q8_0":
        from gguf import GGML_QUANT_VERSION

        w.add_quantization_version(GGML_QUANT_VERSION)
    w.add_context_length(config.get("max_position_embeddings", 2048))
    w.add_embedding_length(hidden)
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    if arch == "qwen3moe":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_count(_n_experts(config))
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_vocab_size(config["vocab_size"])
    tokens, scores, types = _vocab(config["vocab_size"])
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(int(config.get("bos_token_id", 1) or 1))
    w.add_eos_token_id(int(config.get("eos_token_id", 2) or 2))
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)

    for gname, src, _ in plan:
        names = _sources(src)
        shapes = {tuple(index[hf][1]) for hf in names}
        if len(shapes) != 1:
            raise ValueError(f"gguf_writer: {gname} stacks tensors of shapes {sorted(shapes)}")
        shape = list(shapes.pop())
        if not isinstance(src, str):
            shape = [len(names), *shape]
        ggml_type = _ggml_type(gname, shape, kind)
        dtype = {Q.F32: np.float32, Q.BF16: np.uint16, Q.Q8_0: np.uint8}[ggml_type]
        nbytes = _nbytes(shape, ggml_type)
        info_shape = shape if ggml_type != Q.Q8_0 else [*shape[:-1], nbytes // _rows(shape)]
        w.add_tensor_info(gname, info_shape, np.dtype(dtype), nbytes, raw_dtype=ggml_type)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for gname, src, perm in plan:
            parts = []
            for hf in _sources(src):
                with safe_open(str(index[hf][0]), framework="pt") as st:
                    parts.append(st.get_tensor(hf))
            t = parts[0] if isinstance(src, str) else torch.stack(parts)
            del parts
            if perm:
                t = permute_qk(t, n_heads if perm == "q" else n_kv)
            data, _ = _data(t, _kind_of(_ggml_type(gname, list(t.shape), kind)))
            w.write_tensor_data(data)
        w.close()
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


F32_TENSORS = ("ffn_gate_inp.weight",)
"""GGUF tensors written in F32 whatever the type (the MoE router, as llama.cpp's converter
keeps it)."""


def _ggml_type(gname: str, shape: list[int], kind: str) -> Any:
    from gguf import GGMLQuantizationType as Q

    if len(shape) == 1 or gname.endswith(F32_TENSORS):
        return Q.F32
    return Q.BF16 if kind == "bf16" else Q.Q8_0


def _kind_of(ggml_type: Any) -> str:
    from gguf import GGMLQuantizationType as Q

    return {Q.F32: "f32", Q.BF16: "bf16", Q.Q8_0: "q8_0"}[ggml_type]


def _rows(shape: list[int]) -> int:
    n = 1
    for d in shape[:-1]:
        n *= d
    return n


def read_tensors(path: str | Path) -> Iterator[tuple[str, Any, torch.Tensor]]:
    """(GGUF name, GGML type, the tensor as fp32 in HF's [out, in] shape, dequantized) of a
    GGUF file: the round trip the tests check."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader, quants

    reader = GGUFReader(str(path))
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        if t.tensor_type == Q.BF16:
            raw = torch.from_numpy(t.data.copy().view("int16")).view(torch.bfloat16)
            value = raw.to(torch.float32).reshape(shape)
        elif t.tensor_type == Q.F32:
            value = torch.from_numpy(t.data.copy()).reshape(shape)
        else:
            value = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).copy()).reshape(shape)
        yield t.name, t.tensor_type, value


def metadata(path: str | Path) -> dict[str, Any]:
    """The scalar and string keys of a GGUF file (arrays as their length)."""
    from gguf import GGUFReader, GGUFValueType

    out: dict[str, Any] = {}
    for name, field in GGUFReader(str(path)).fields.items():
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            out[name] = len(field.data)
        elif field.types[0] == GGUFValueType.STRING:
            out[name] = bytes(field.parts[field.data[0]]).decode()
        else:
            out[name] = field.parts[field.data[0]].tolist()[0]
    return out


def main(argv: Optional[list[str]] = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--type", default="bf16", choices=TYPES)
    args = p.parse_args(argv)
    path = write_gguf(args.model_dir, args.out, args.type)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {args.type})")
    return path


if __name__ == "__main__":
    main()
