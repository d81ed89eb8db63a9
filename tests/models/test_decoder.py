"""Decoder family vs transformers: prefill logits and greedy generation, batched and alone."""

from __future__ import annotations

import pytest
import torch
from checkpoints import FAMILIES
from paged_harness import PagedHarness, hf_greedy
from transformers import AutoModelForCausalLM

from models.loader import load_model

PROMPT_LENS = (5, 11, 23)  # 23 + 12 new tokens crosses Mistral's 16-token window
NEW_TOKENS = 12


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module", params=FAMILIES)
def family_models(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    model, config = load_model(path, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, model, config, hf


def _hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]  # [L, V]


def test_prefill_logits_match_transformers_batched_and_alone(family_models):
    family, model, config, hf = family_models
    prompts = _prompts(config.vocab_size)
    refs = [_hf_logits(hf, p) for p in prompts]
    batched = PagedHarness(model).prefill_logits(prompts)
    for p, ours, ref in zip(prompts, batched, refs):
        torch.testing.assert_close(
            ours, ref, atol=1e-4, rtol=0, msg=lambda m: f"{family} batched, len {len(p)}: {m}"
        )
    for p, ref in zip(prompts, refs):
        (alone,) = PagedHarness(model).prefill_logits([p])
        torch.testing.assert_close(
            alone, ref, atol=1e-4, rtol=0, msg=lambda m: f"{family} alone, len {len(p)}: {m}"
        )


def test_prefill_with_padded_batch(family_models):
    """Padding rows (slot -1) past the real tokens must not change the real rows."""
    family, model, config, hf = family_models
    prompts = _prompts(config.vocab_size, lens=(3, 6), seed=1)
    padded = PagedHarness(model).prefill_logits(prompts, pad_to=16)
    for p, ours in zip(prompts, padded):
        torch.testing.assert_close(ours, _hf_logits(hf, p), atol=1e-4, rtol=0)


def test_greedy_generation_equals_transformers(family_models):
    family, model, config, hf = family_models
    prompts = _prompts(config.vocab_size, seed=2)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert PagedHarness(model).greedy(prompts, NEW_TOKENS) == expected, f"{family} batched"
    for p, exp in zip(prompts, expected):
        assert PagedHarness(model).greedy([p], NEW_TOKENS) == [exp], f"{family} alone"
    # Staggered arrivals: later requests prefill in the same step as earlier ones decode,
    # and the flat batch is padded to a multiple of 8 as CUDA-graph sizes would.
    mixed = PagedHarness(model, block_size=8).greedy(
        prompts, NEW_TOKENS, arrival_steps=[0, 2, 3], pad_multiple=8
    )
    assert mixed == expected, f"{family} mixed prefill/decode"


def test_decode_logits_match_transformers_full_forward(family_models):
    """Every decode step's logits (read through the paged KV cache) equal transformers'
    logits of the whole sequence at that position -- stronger than comparing argmaxes."""
    family, model, config, hf = family_models
    prompts = _prompts(config.vocab_size, seed=3)
    tokens, logits = PagedHarness(model, block_size=4).greedy(
        prompts, NEW_TOKENS, arrival_steps=[1, 0, 2], return_logits=True
    )
    for p, new, ours in zip(prompts, tokens, logits):
        ref = _hf_logits(hf, p + new[:-1])[len(p) - 1 :]  # [NEW_TOKENS, V]
        torch.testing.assert_close(
            ours, ref, atol=1e-4, rtol=0, msg=lambda m: f"{family}, prompt len {len(p)}: {m}"
        )


def test_module_names_and_attention_layers(llama_checkpoint):
    model, config = load_model(llama_checkpoint, torch.float32)
    names = dict(model.named_modules())
    for sub in (
        "model.embed_tokens",
        "model.layers.1.self_attn.qkv_proj",
        "model.layers.1.self_attn.o_proj",
        "model.layers.1.mlp.gate_up_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.norm",
        "lm_head",
    ):
        assert sub in names, sub
    assert model.attention_layer_names() == [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    ]
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.shape == (
        (config.num_heads + 2 * config.num_kv_heads) * config.head_dim,
        config.hidden_size,
    )


def test_qwen3_has_qk_norm_and_own_head_dim(tiny_checkpoint):
    model, config = load_model(tiny_checkpoint("qwen3"), torch.float32)
    attn = model.model.layers[0].self_attn
    assert config.head_dim == 32 != config.hidden_size // config.num_heads
    assert attn.q_norm.weight.shape == (32,) and attn.k_norm.weight.shape == (32,)
    assert attn.o_proj.weight.shape == (config.hidden_size, config.num_heads * 32)


def test_mistral_window_reaches_the_attention_op(tiny_checkpoint):
    model, config = load_model(tiny_checkpoint("mistral"), torch.float32)
    assert config.sliding_window == 16
    assert all(m.self_attn.attn.sliding_window == 16 for m in model.model.layers)


def test_forward_traces_once_with_symbolic_token_count(llama_checkpoint):
    """Dynamo captures the whole forward in one graph (fullgraph) with a dynamic T and the
    attention op left opaque; a second token count reuses the graph."""
    model, _ = load_model(llama_checkpoint, torch.float32)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=None)
    for n in (7, 3):
        harness = PagedHarness(model)
        eager = harness.prefill_logits([list(range(1, n + 1))])[0]
        harness_c = PagedHarness(model)
        harness_c.model = _CompiledView(compiled, model)
        ours = harness_c.prefill_logits([list(range(1, n + 1))])[0]
        torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("piecewise.attention" in t for t in targets) == 2


class _CompiledView:
    """Harness-compatible view of a compiled model (forward compiled, the rest eager)."""

    def __init__(self, compiled, model):
        self.compiled, self.model, self.config = compiled, model, model.config

    def __call__(self, input_ids, positions):
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        return self.compiled(input_ids, positions)

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


def test_qwen2_per_layer_sliding_window_matches_transformers(tmp_path):
    """Qwen2/3 window only layers >= max_window_layers when use_sliding_window is set."""
    from checkpoints import build_family_checkpoint

    path = build_family_checkpoint(
        tmp_path / "c", "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    model, config = load_model(path, torch.float32)
    assert [l.self_attn.attn.sliding_window for l in model.model.layers] == [-1, 8]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(config.vocab_size, lens=(20, 9), seed=4)
    tokens, logits = PagedHarness(model).greedy(prompts, NEW_TOKENS, return_logits=True)
    for p, new, ours in zip(prompts, tokens, logits):
        ref = _hf_logits(hf, p + new[:-1])[len(p) - 1 :]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
