"""Fusion passes on a whole tiny Llama-style model through the piecewise backend: expected
match counts per layer for each quantization, and outputs unchanged by the passes."""

import pytest

from framework import LLM, CompilationConfig

FUSIONS = [
    "noop_elimination",
    "fuse_add_rmsnorm",
    "fuse_rmsnorm_quant",
    "fuse_silu_mul_quant",
    "fix_functionalization",
]
PROMPTS = [[3, 17, 42, 9, 100, 7], [8, 1, 250]]


def _run(path, quantization, passes, cache_dir, compiler="inductor"):
    cc = CompilationConfig(
        level=1, compiler=compiler, progress_bar=False, pass_config={"passes": passes}
    )
    llm = LLM(
        str(path),
        compilation_config=cc,
        quantization=quantization,
        max_num_seqs=2,
        max_model_len=64,
        cache_dir=cache_dir,
    )
    return llm, llm.generate(PROMPTS, 8, ignore_eos=True)


@pytest.mark.parametrize("quantization", ["int8_per_token", "fp8_per_token"])
def test_fusions_match_per_layer(quantization, llama_checkpoint, compile_cache_dir):
    llm, fused = _run(llama_checkpoint, quantization, FUSIONS, compile_cache_dir, compiler="eager")
    layers = llm.model_config.num_layers
    matches = {name: rec["total_matches"] for name, rec in llm.stats["passes"].items()}
    # residual add + RMSNorm: post-attention norm of every layer and the input norm of every
    # layer but the first (whose residual is the embedding), plus the final norm
    assert matches["fuse_add_rmsnorm"] == 2 * layers
    # both norms of a layer feed a quantized projection (qkv, gate_up)
    assert matches["fuse_rmsnorm_quant"] == 2 * layers
    assert matches["fuse_silu_mul_quant"] == layers
    _, plain = _run(llama_checkpoint, quantization, [], compile_cache_dir, compiler="eager")
    assert fused == plain


def test_fusions_under_inductor_keep_outputs(llama_checkpoint, tmp_path, monkeypatch):
    """A cold cache (a warm one would load artifacts and run no pass): the passes run as
    Inductor's post-grad pass, match as under the eager adaptor, and keep the outputs.
    Inductor's own caches start empty too: an FX-graph cache hit (an earlier run compiled
    the same pieces) also skips the post-grad passes."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    llm, fused = _run(llama_checkpoint, "int8_per_token", FUSIONS, str(tmp_path / "cache"))
    ref = LLM(
        str(llama_checkpoint), quantization="int8_per_token", max_num_seqs=2, max_model_len=64
    )
    assert fused == ref.generate(PROMPTS, 8, ignore_eos=True)
    assert llm.stats["compile_compiles"] > 0 and llm.stats["compile_loads"] == 0
    layers = llm.model_config.num_layers
    matches = {name: rec["total_matches"] for name, rec in llm.stats["passes"].items()}
    assert matches["fuse_add_rmsnorm"] == 2 * layers, llm.stats["passes"]
    assert matches["fuse_rmsnorm_quant"] == 2 * layers
    assert matches["fuse_silu_mul_quant"] == layers
