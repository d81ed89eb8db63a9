"""The GGUF writer for llama.cpp (experiments/bench/gguf_writer.py): the q/k permutation is
llama.cpp's rope convention applied to HF's, it round-trips, and a written file reads back
(gguf's own reader) as the checkpoint's tensors with llama.cpp's names and hyper-parameters."""

from __future__ import annotations

import json

import pytest
import torch

from experiments.bench import gguf_writer


def _hf_rope(x: torch.Tensor, pos: int, base: float = 10000.0) -> torch.Tensor:
    """transformers' rotary embedding of one head vector ``x [d]`` at ``pos``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos * torch.cat([inv, inv])
    cos, sin = ang.cos()[None, None], ang.sin()[None, None]
    q, _ = apply_rotary_pos_emb(x[None, None, None], x[None, None, None], cos, sin)
    return q[0, 0, 0]


def _interleaved_rope(x: torch.Tensor, pos: int, base: float = 10000.0) -> torch.Tensor:
    """llama.cpp's normal (non-NeoX) rope: adjacent pairs (2j, 2j+1) rotated by pos * theta_j."""
    d = x.shape[-1]
    theta = pos / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[0::2], x[1::2]
    out = torch.empty_like(x)
    out[0::2] = a * theta.cos() - b * theta.sin()
    out[1::2] = a * theta.sin() + b * theta.cos()
    return out


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_permutation_round_trips_and_moves_pairs(heads):
    d = 8
    w = torch.randn(heads * d, 5)
    p = gguf_writer.permute_qk(w, heads)
    assert torch.equal(gguf_writer.unpermute_qk(p, heads), w)
    assert not torch.equal(p, w)
    for h in range(heads):  # row 2j of a head is HF row j, row 2j+1 is HF row j + d/2
        for j in range(d // 2):
            assert torch.equal(p[h * d + 2 * j], w[h * d + j])
            assert torch.equal(p[h * d + 2 * j + 1], w[h * d + j + d // 2])
    with pytest.raises(ValueError, match="heads"):
        gguf_writer.permute_qk(torch.randn(6, 3), 4)


def test_llamacpp_rope_on_the_permuted_projection_is_hfs_rope_permuted():
    """What the permutation is for: llama.cpp's rope of (permuted W) x equals the permutation
    of HF's rope of W x at every position (so q.k, and attention, are unchanged)."""
    torch.manual_seed(0)
    heads, d, hidden = 4, 16, 32
    w = torch.randn(heads * d, hidden, dtype=torch.float64)
    x = torch.randn(hidden, dtype=torch.float64)
    pw = gguf_writer.permute_qk(w, heads)
    for pos in (0, 1, 7, 100):
        hf = torch.cat([_hf_rope((w @ x)[h * d : (h + 1) * d], pos) for h in range(heads)])
        cpp = torch.cat(
            [_interleaved_rope((pw @ x)[h * d : (h + 1) * d], pos) for h in range(heads)]
        )
        assert torch.allclose(cpp, gguf_writer.permute_qk(hf[:, None], heads)[:, 0], atol=1e-9)
        if pos:  # and without the permutation they differ: the test can fail
            assert not torch.allclose(
                torch.cat(
                    [_interleaved_rope((w @ x)[h * d : (h + 1) * d], pos) for h in range(heads)]
                ),
                hf,
            )


def test_tensor_plan_names_every_llama_tensor(llama_checkpoint):
    config = json.loads((llama_checkpoint / "config.json").read_text())
    names = set(gguf_writer._tensor_index(llama_checkpoint))
    plan = gguf_writer.tensor_plan(config, names)
    assert {hf for _, hf, _ in plan} == names  # every checkpoint tensor, once
    g = {name: perm for name, _, perm in plan}
    assert g["blk.0.attn_q.weight"] == "q" and g["blk.1.attn_k.weight"] == "k"
    assert g["blk.0.attn_v.weight"] == "" and "output.weight" in g
    with pytest.raises(KeyError, match="lacks"):
        gguf_writer.tensor_plan(config, names - {"model.norm.weight"})


@pytest.mark.parametrize("kind", ["bf16", "q8_0"])
def test_written_file_reads_back_as_the_checkpoint(tmp_path, llama_checkpoint, kind):
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    config = json.loads((llama_checkpoint / "config.json").read_text())
    out = gguf_writer.write_gguf(llama_checkpoint, tmp_path / f"m-{kind}.gguf", kind)
    assert not list(tmp_path.glob(".*tmp"))
    meta = gguf_writer.metadata(out)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == config["num_hidden_layers"]
    assert meta["llama.embedding_length"] == config["hidden_size"]
    assert meta["llama.attention.head_count"] == config["num_attention_heads"]
    assert meta["llama.attention.head_count_kv"] == config["num_key_value_heads"]
    assert meta["llama.feed_forward_length"] == config["intermediate_size"]
    assert meta["tokenizer.ggml.tokens"] == config["vocab_size"]
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])

    ckpt = load_file(str(llama_checkpoint / "model.safetensors"))
    plan = {g: (hf, perm) for g, hf, perm in gguf_writer.tensor_plan(config, set(ckpt))}
    seen = set()
    for name, ggml_type, value in gguf_writer.read_tensors(out):
        hf, perm = plan[name]
        seen.add(name)
        ref = ckpt[hf].to(torch.float32)
        if perm:
            heads = config["num_attention_heads"] if perm == "q" else config["num_key_value_heads"]
            value = gguf_writer.unpermute_qk(value, heads)
        assert value.shape == ref.shape, name
        if ref.dim() == 1:
            assert ggml_type == Q.F32 and torch.equal(value, ref), name
        elif kind == "bf16":
            assert ggml_type == Q.BF16
            assert torch.equal(value, ref.to(torch.bfloat16).to(torch.float32)), name
        else:
            assert ggml_type == Q.Q8_0
            # blocks of 32 along the input dimension, one fp16 scale each: error <= half a
            # step plus the scale's own rounding (127 steps x 2^-11)
            blocks = ref.reshape(-1, 32)
            err = (value.reshape(-1, 32) - blocks).abs().amax(1)
            scale = blocks.abs().amax(1) / 127
            assert (err <= scale * (0.5 + 127 * 2**-11) + 1e-7).all(), name
            assert (err > 0).any()  # it is quantized
    assert seen == set(plan)


# --- Qwen3-MoE (llama.cpp's qwen3moe) ---------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_moe_checkpoint(tmp_path_factory):
    """test-qwen3_moe with every layer a MoE one (llama.cpp's qwen3moe has no dense layers)."""
    from tests.checkpoints import build_family_checkpoint

    root = tmp_path_factory.mktemp("ckpt-qwen3moe-all")
    return build_family_checkpoint(root / "qwen3_moe", "qwen3_moe", mlp_only_layers=[])


def test_moe_plan_stacks_the_experts_and_permutes_nothing(qwen3_moe_checkpoint):
    config = json.loads((qwen3_moe_checkpoint / "config.json").read_text())
    names = set(gguf_writer._tensor_index(qwen3_moe_checkpoint))
    plan = gguf_writer.tensor_plan(config, names)
    flat = [hf for _, src, _ in plan for hf in gguf_writer._sources(src)]
    assert sorted(flat) == sorted(names)  # every checkpoint tensor, once
    g = {name: (src, perm) for name, src, perm in plan}
    assert all(perm == "" for _, perm in g.values())  # NeoX rope: nothing permuted
    E = gguf_writer._n_experts(config)
    for proj in ("gate", "up", "down"):
        src, _ = g[f"blk.1.ffn_{proj}_exps.weight"]
        assert src == tuple(f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight" for e in range(E))
    assert g["blk.0.ffn_gate_inp.weight"][0] == "model.layers.0.mlp.gate.weight"
    assert g["blk.2.attn_q_norm.weight"][0] == "model.layers.2.self_attn.q_norm.weight"
    assert "blk.0.ffn_gate.weight" not in g


def test_moe_with_a_dense_layer_is_refused(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")  # mlp_only_layers [1]
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no dense layers; layers \[1\]"):
        gguf_writer.tensor_plan(config, set(gguf_writer._tensor_index(folder)))


def test_moe_file_reads_back_stacked_with_the_expert_keys(tmp_path, qwen3_moe_checkpoint):
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file

    config = json.loads((qwen3_moe_checkpoint / "config.json").read_text())
    out = gguf_writer.write_gguf(qwen3_moe_checkpoint, tmp_path / "moe.gguf", "bf16")
    meta = gguf_writer.metadata(out)
    assert meta["general.architecture"] == "qwen3moe"
    assert meta["qwen3moe.expert_count"] == gguf_writer._n_experts(config) == 6
    assert meta["qwen3moe.expert_used_count"] == config["num_experts_per_tok"]
    assert meta["qwen3moe.expert_feed_forward_length"] == config["moe_intermediate_size"]
    assert meta["qwen3moe.attention.key_length"] == config["head_dim"]
    ckpt = load_file(str(qwen3_moe_checkpoint / "model.safetensors"))
    plan = {g: src for g, src, _ in gguf_writer.tensor_plan(config, set(ckpt))}
    seen = set()
    for name, ggml_type, value in gguf_writer.read_tensors(out):
        src = plan[name]
        seen.add(name)
        if isinstance(src, str):
            ref = ckpt[src].to(torch.float32)
        else:
            ref = torch.stack([ckpt[hf] for hf in src]).to(torch.float32)
            assert value.shape == (6, *ckpt[src[0]].shape), name
        assert value.shape == ref.shape, name
        if ref.dim() == 1 or name.endswith("ffn_gate_inp.weight"):
            assert ggml_type == Q.F32 and torch.equal(value, ref), name
        else:
            assert ggml_type == Q.BF16
            assert torch.equal(value, ref.to(torch.bfloat16).to(torch.float32)), name
    assert seen == set(plan)


def test_llamacpp_runs_the_moe_file_as_transformers_does(tmp_path, qwen3_moe_checkpoint):
    """llama.cpp's logits of the written file match transformers' on the same (bf16-rounded)
    weights: names, stacking, the router and the q/k norms are read as meant."""
    pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM

    from experiments.bench.peer_worker import LlamaCppRunner

    out = gguf_writer.write_gguf(qwen3_moe_checkpoint, tmp_path / "moe.gguf", "bf16")
    hf = AutoModelForCausalLM.from_pretrained(qwen3_moe_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    prompt = [5, 17, 42, 99, 3, 200, 7, 11]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    job = {"gguf": str(out), "batches": [1], "prompt_len": len(prompt), "new_tokens": [4],
           "check_tokens": 4, "threads": 1}  # fmt: skip
    runner = LlamaCppRunner(job)
    try:
        import numpy as np

        runner.generate([prompt], 1)
        logits = runner.L.llama_get_logits(runner.ctx)
        got = torch.from_numpy(np.ctypeslib.as_array(logits, shape=(1, runner.n_vocab)).copy())[0]
        cpp_tokens = runner.generate([prompt], 12)[0]
    finally:
        runner.close()
    assert got.shape == want.shape
    # llama.cpp rounds activations to bf16 before its bf16 matmuls: close, not equal (0.5%
    # of the largest logit here; 9% with the gate and up stacks swapped)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 0.02 * scale, (got - want).abs().max() / scale
    assert int(got.argmax()) == int(want.argmax())
    # and greedy tokens: transformers fp32 on the same bf16-rounded weights
    ids, hf_tokens = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(12):
            nxt = hf(ids).logits[0, -1].argmax()
            hf_tokens.append(int(nxt))
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
    assert cpp_tokens == hf_tokens
