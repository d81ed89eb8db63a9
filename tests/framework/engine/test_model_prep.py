"""Model preparation: quantizing while the checkpoint streams in gives exactly the weights of
quantizing afterwards; the loader reports each parameter once it is complete."""

from __future__ import annotations

import pytest
import torch

from framework.engine.model_prep import load_quantized
from models.loader import load_model, load_weights
from passes.quant_schemes import quantize_model


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: tied embeddings, qkv bias
@pytest.mark.parametrize("scheme", ["int8_per_token", "int8_per_channel_weight_only"])
def test_quantizing_while_loading_equals_quantizing_after(tiny_checkpoint, family, scheme):
    ckpt = tiny_checkpoint(family)
    after, _ = load_model(ckpt, torch.float32)
    expected = quantize_model(after, scheme)
    model, _, (qc, qhash, layers) = load_quantized(ckpt, torch.float32, "cpu", scheme)
    assert layers == expected and qc is not None and qhash == qc.compute_hash()
    want = after.state_dict()
    got = model.state_dict()
    assert want.keys() == got.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    assert repr(model.model.layers[0].self_attn.qkv_proj.linear_method) == repr(
        after.model.layers[0].self_attn.qkv_proj.linear_method
    )


def test_loader_reports_each_parameter_once_complete(llama_checkpoint):
    model, _ = load_model(llama_checkpoint, torch.float32)
    seen: list[str] = []
    complete: dict[str, bool] = {}
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    reference = dict(model.named_parameters())[qkv].detach().clone()

    def loaded(name: str) -> None:
        seen.append(name)
        if name == qkv:  # all three row blocks (q, k, v) are in when it is reported
            complete[name] = torch.equal(dict(model.named_parameters())[name], reference)

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_weights(model, llama_checkpoint, loaded)
    assert sorted(seen) == sorted(n for n, _ in model.named_parameters())
    assert complete == {qkv: True}


def test_without_quantization_it_is_plain_loading(llama_checkpoint):
    model, _, quantized = load_quantized(llama_checkpoint, torch.float32, "cpu", None)
    assert quantized == (None, None, None)
    ref, _ = load_model(llama_checkpoint, torch.float32)
    for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("quant", [None, "int8_per_token"], ids=["bf16", "int8"])
def test_warm_start_registers_the_linear_ops_cpp_kernels(llama_checkpoint, tmp_path, quant):
    """A warm start maps the processed weights and runs no method's ``process`` (which is
    where a cold start registers the C++ kernels): it must register them itself, or every
    linear call of the restored model runs its op's Python body."""
    from framework.core.config import CompilationConfig
    from framework.engine import model_prep
    from passes import small_m_linear
    from passes.registry import level_passes

    if not small_m_linear.kernel_available():
        pytest.skip("no small-M kernel on this machine")
    cfg = CompilationConfig(level=2, cache_dir=str(tmp_path)).resolve(
        max_num_tokens=64, level_passes=level_passes, has_cuda=False
    )
    cold = model_prep.prepare_model(llama_checkpoint, torch.bfloat16, "cpu", quant, cfg)
    assert cold.weights_cache == "written" and cold.packed_layers
    calls = []
    real = model_prep.native_ops.load
    try:
        model_prep.native_ops.load = lambda: calls.append(1) or real()
        warm = model_prep.prepare_model(llama_checkpoint, torch.bfloat16, "cpu", quant, cfg)
    finally:
        model_prep.native_ops.load = real
    assert warm.weights_cache == "hit" and warm.packed_layers == cold.packed_layers
    assert calls, "the warm start did not register the C++ kernels"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("piecewise::packed_linear", "CPU")


@pytest.mark.parametrize("quant", [None, "int8_per_token"], ids=["bf16", "int8"])
def test_packed_weights_move_to_huge_page_memory_and_compute_the_same(llama_checkpoint, quant):
    """Every re-laid-out weight of the allocator's size or more is a copy in its own
    2 MB-aligned mapping (the tiny model's weights are small: the threshold is lowered to
    reach them); the rest stays; the greedy tokens do not change."""
    from paged_harness import PagedHarness

    from framework.core.config import CompilationConfig, PassConfig
    from framework.core.huge_pages import HUGE_PAGE, HugePageAllocator
    from framework.engine.model_prep import process_weights, relaid_parameters

    config = CompilationConfig(pass_config=PassConfig(passes=["prepack_linear"]))
    prompts, new = [[3, 17, 42, 9, 100, 7], [8, 1, 250]], 6
    tokens = {}
    for threshold in (None, 8 << 10):
        model, _, _ = load_quantized(llama_checkpoint, torch.bfloat16, "cpu", quant)
        alloc = HugePageAllocator(mode="madvise", **({"min_bytes": threshold} if threshold else {}))
        packed = process_weights(model, config, alloc)
        assert packed
        relaid = [p for n in packed for p in relaid_parameters(model.get_submodule(n)).values()]
        big = [p for p in relaid if p.numel() * p.element_size() >= alloc.min_bytes]
        if threshold is None:
            assert alloc.huge_bytes == sum(p.numel() * p.element_size() for p in big)
        else:
            assert big and alloc.huge_bytes == sum(p.numel() * p.element_size() for p in big)
            assert all(p.data_ptr() % HUGE_PAGE == 0 for p in big)
            assert all(isinstance(p, torch.nn.Parameter) and not p.requires_grad for p in big)
        tokens[threshold] = PagedHarness(model).greedy(prompts, new)
    assert tokens[None] == tokens[8 << 10]


@pytest.mark.parametrize("quant", [None, "int8_per_token"], ids=["bf16", "int8"])
def test_by_default_every_relaid_weight_lies_in_shared_huge_page_slabs(llama_checkpoint, quant):
    """``process_weights``' own allocator (``HugePageAllocator.for_weights``): every re-laid
    weight of a small page or more, however small, is carved from a slab advised
    MADV_HUGEPAGE (a few slabs for the whole model, not a mapping each); the greedy tokens
    equal those of the same weights left in torch's memory."""
    from paged_harness import PagedHarness

    from framework.core import huge_pages as hp
    from framework.core.config import CompilationConfig, PassConfig
    from framework.engine.model_prep import process_weights, relaid_parameters

    if not hp.HugePageAllocator().enabled:
        pytest.skip(f"transparent huge pages are {hp.thp_mode()}")
    config = CompilationConfig(pass_config=PassConfig(passes=["prepack_linear"]))
    prompts, new = [[3, 17, 42, 9, 100, 7], [8, 1, 250]], 6
    tokens = []
    for alloc in (None, hp.HugePageAllocator(mode="never")):
        model, _, _ = load_quantized(llama_checkpoint, torch.bfloat16, "cpu", quant)
        packed = process_weights(model, config, alloc)
        relaid = [p for n in packed for p in relaid_parameters(model.get_submodule(n)).values()]
        placed = [p for p in relaid if p.numel() * p.element_size() >= hp.SLAB_ALIGN]
        if alloc is None:
            assert placed and all(p.data_ptr() % hp.SLAB_ALIGN == 0 for p in placed)
            backing = hp.page_backing(placed)
            assert backing.advised == backing.mappings
            assert 1 <= backing.mappings <= 2  # the tiny model's weights: one 32 MB slab
            assert backing.size >= sum(p.numel() * p.element_size() for p in placed)
        tokens.append(PagedHarness(model).greedy(prompts, new))
    assert tokens[0] == tokens[1]
