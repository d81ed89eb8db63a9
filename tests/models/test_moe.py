"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) vs transformers: config
mapping, stacked expert weights (one copy), prefill logits, greedy tokens batched and with
mixed prefill/decode steps, and through ``LLM`` at O0 and O2 (cold and warm)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import MOE_FAMILIES, derive_checkpoint
from paged_harness import PagedHarness, hf_greedy
from transformers import AutoModelForCausalLM

from framework import LLM
from models.config import ModelConfig
from models.loader import CheckpointError, load_model
from models.moe import FusedMoE, SparseMoeBlock

PROMPT_LENS = (5, 11, 23)  # 23 + new tokens crosses the 16-token windows
NEW_TOKENS = 10


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_models(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    model, config = load_model(path, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, model, config, hf


def test_config_mapping(tiny_checkpoint):
    q3 = ModelConfig.from_hf_dir(tiny_checkpoint("qwen3_moe"))
    assert (q3.num_experts, q3.num_experts_per_tok, q3.moe_intermediate_size) == (6, 2, 72)
    assert q3.norm_topk_prob and q3.shared_expert_intermediate_size == 0
    assert [q3.is_moe_layer(i) for i in range(3)] == [True, False, True]  # mlp_only_layers=[1]
    assert q3.sliding_window is None and q3.qk_norm
    q2 = ModelConfig.from_hf_dir(tiny_checkpoint("qwen2_moe"))
    assert q2.shared_expert_intermediate_size == 96 and not q2.norm_topk_prob
    assert q2.attention_bias and not q2.o_proj_bias
    assert [q2.layer_sliding_window(i) for i in range(2)] == [16, -1]
    mx = ModelConfig.from_hf_dir(tiny_checkpoint("mixtral"))
    assert mx.norm_topk_prob and mx.moe_intermediate_size == 72 and mx.vocab_size == 251
    assert [mx.layer_sliding_window(i) for i in range(2)] == [16, 16]
    sparse = ModelConfig.from_dict(
        q3.to_dict(), num_layers=4, decoder_sparse_step=2, mlp_only_layers=None
    )
    assert [sparse.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict(q3.to_dict(), num_experts_per_tok=7)


def test_experts_are_stacked_once(moe_models):
    family, _, model, config, hf = moe_models
    names = [n for n, _ in model.named_parameters()]
    assert not any(".experts.0." in n for n in names), "per-expert tensors must not be kept"
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == sum(config.is_moe_layer(i) for i in range(config.num_layers))
    E, I, H = config.num_experts, config.moe_intermediate_size, config.hidden_size  # noqa: E741
    hf_params = dict(hf.named_parameters())
    for layer, hf_layer in zip(model.model.layers, hf.model.layers):
        if not isinstance(layer.mlp, SparseMoeBlock):
            continue
        experts = layer.mlp.experts
        assert isinstance(experts, FusedMoE)
        assert experts.w13.shape == (E, 2 * I, H) and experts.w2.shape == (E, H, I)
        hf_moe = getattr(hf_layer, "mlp", None) or hf_layer.block_sparse_moe
        # transformers 5 fuses experts the same way: gate rows then up rows.
        torch.testing.assert_close(experts.w13, hf_moe.experts.gate_up_proj, rtol=0, atol=0)
        torch.testing.assert_close(experts.w2, hf_moe.experts.down_proj, rtol=0, atol=0)
    n_ours = sum(p.numel() for p in model.parameters())
    assert n_ours == sum(p.numel() for p in hf_params.values())


def test_prefill_logits_match_transformers(moe_models):
    family, _, model, config, hf = moe_models
    prompts = _prompts(config.vocab_size)
    batched = PagedHarness(model).prefill_logits(prompts)
    for p, ours in zip(prompts, batched):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0, msg=lambda m: f"{family}: {m}")


def test_greedy_matches_transformers_batched_and_mixed(moe_models):
    family, _, model, config, hf = moe_models
    prompts = _prompts(config.vocab_size, seed=2)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert PagedHarness(model).greedy(prompts, NEW_TOKENS) == expected, family
    mixed = PagedHarness(model, block_size=8).greedy(
        prompts, NEW_TOKENS, arrival_steps=[0, 2, 3], pad_multiple=8
    )
    assert mixed == expected, f"{family} mixed prefill/decode, padded"


def test_missing_expert_tensor_is_named(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3_moe")
    dst = derive_checkpoint(
        src,
        tmp_path / "broken",
        edit_tensors=lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"),
    )
    with pytest.raises(CheckpointError, match=r"experts\.5\.up_proj\.weight"):
        load_model(dst, torch.float32)


def _hf_generate(path, prompts, n):
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return [hf_greedy(hf, p, n) for p in prompts]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_llm_o0_matches_transformers(family, tiny_checkpoint):
    path = tiny_checkpoint(family)
    prompts = _prompts(251, seed=4)
    expected = _hf_generate(path, prompts, NEW_TOKENS)
    llm = LLM(str(path), optimization_level=0, max_num_seqs=4, max_model_len=64)
    assert llm.generate(prompts, NEW_TOKENS, ignore_eos=True) == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_llm_o2_cold_and_warm_match_transformers(family, tiny_checkpoint, compile_cache_dir):
    path = tiny_checkpoint(family)
    prompts = _prompts(251, seed=4)
    expected = _hf_generate(path, prompts, NEW_TOKENS)
    kw = dict(optimization_level=2, max_num_seqs=4, max_model_len=64, cache_dir=compile_cache_dir)
    cold = LLM(str(path), **kw)
    assert cold.stats["compile_num_splitting_ops"] == cold.model_config.num_layers
    assert cold.generate(prompts, NEW_TOKENS, ignore_eos=True) == expected
    warm = LLM(str(path), **kw)
    assert warm.stats["compile_compiles"] == 0
    assert warm.generate(prompts, NEW_TOKENS, ignore_eos=True) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_llm_on_gpu_with_graphs_matches_transformers(family, tiny_checkpoint):
    """fp32 on CUDA at O2 with FULL_AND_PIECEWISE graphs: the Triton attention backend and
    the Triton grouped-GEMM MoE kernel captured inside the graphs (the MoE op is not a split
    point), greedy tokens equal to transformers'."""
    from cuda_llm import cuda_llm

    from framework.cudagraph.wrapper import clear_all_graphs

    path = tiny_checkpoint(family)
    prompts = _prompts(251, seed=4)
    expected = _hf_generate(path, prompts, NEW_TOKENS)
    llm = cuda_llm(path, "FULL_AND_PIECEWISE")
    assert llm.stats["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert llm.generate(prompts, NEW_TOKENS, ignore_eos=True) == expected
    assert llm.graphs.stats().replays > 0
    clear_all_graphs()


QUANT = {
    "linear": "int8_per_token",
    "moe": "int8_per_token",
    "ignore": ["*.mlp.gate", "*.shared_expert_gate"],
}


@pytest.mark.parametrize("moe_spec", ["int8_per_token", "int8_per_channel_weight_only"])
def test_quantization_reaches_the_experts_not_the_router(tiny_checkpoint, moe_spec):
    from passes.quant_schemes import quantize_model

    path = tiny_checkpoint("qwen2_moe")
    ref_model, config = load_model(path, torch.float32)
    model, _ = load_model(path, torch.float32)
    report = quantize_model(model, dict(QUANT, moe=moe_spec))
    block = model.model.layers[0].mlp
    assert report["model.layers.0.mlp.experts"] in ("int8_dynamic_per_token", "int8_weight_only")
    assert "model.layers.0.mlp.gate" not in report
    assert "model.layers.0.mlp.shared_expert_gate" not in report
    assert "model.layers.0.mlp.shared_expert.gate_up_proj" in report
    assert block.experts.w13.dtype == torch.int8 and block.experts.w2.dtype == torch.int8
    assert block.experts.w13_scale.shape == block.experts.w13.shape[:2]
    assert block.gate.weight.dtype == torch.float32
    prompts = _prompts(config.vocab_size, seed=5)
    ours = PagedHarness(model).prefill_logits(prompts)
    refs = PagedHarness(ref_model).prefill_logits(prompts)
    agree = [(o.argmax(-1) == r.argmax(-1)).float().mean().item() for o, r in zip(ours, refs)]
    print(f"int8 ({moe_spec} experts) prefill top-1 agreement with fp32: {agree}")
    assert min(agree) >= 0.8
    for o, r in zip(ours, refs):
        assert (o - r).abs().max() < 0.1 * r.abs().max()


def test_bad_expert_spec_is_named(tiny_checkpoint):
    from passes.quant_schemes import quantize_model

    model, _ = load_model(tiny_checkpoint("mixtral"), torch.float32)
    with pytest.raises(ValueError, match=r"MoE experts 'model.layers.0.mlp.experts'"):
        quantize_model(model, {"moe": "fp8_per_tensor"})
