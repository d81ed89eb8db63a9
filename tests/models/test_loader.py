"""Safetensors loading: good checkpoints (single, sharded, tied, cast) and every bad one."""

from __future__ import annotations

import json
import re

import pytest
import torch
from checkpoints import build_sharded_checkpoint, derive_checkpoint
from paged_harness import PagedHarness

from models.loader import CheckpointError, checkpoint_tensor_files, load_model

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_loads_like_single_file(tmp_path, llama_checkpoint):
    sharded = build_sharded_checkpoint(tmp_path / "sharded", "llama")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(set(checkpoint_tensor_files(sharded).values())) > 2
    single, _ = load_model(llama_checkpoint, torch.float32)
    multi, _ = load_model(sharded, torch.float32)
    a, b = _state(single), _state(multi)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_merged_projections_hold_the_hf_blocks(llama_checkpoint):
    from safetensors.torch import load_file

    hf = load_file(str(llama_checkpoint / "model.safetensors"))
    model, c = load_model(llama_checkpoint, torch.float32)
    layer = model.model.layers[0]
    qkv = torch.cat([hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([hf[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)


def test_tied_embeddings_share_one_parameter(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    assert "lm_head.weight" not in checkpoint_tensor_files(path)
    model, config = load_model(path, torch.float32)
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # qkv bias (Qwen2) was loaded, not left uninitialized.
    assert model.model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0


def test_tied_checkpoint_that_also_stores_lm_head_is_fine(tmp_path, tiny_checkpoint):
    def add_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    path = derive_checkpoint(tiny_checkpoint("qwen2"), tmp_path / "c", edit_tensors=add_head)
    model, _ = load_model(path, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_cast_to_requested_dtype_and_no_meta_left(llama_checkpoint):
    model, config = load_model(llama_checkpoint, "bfloat16")
    assert config.dtype == "bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.model.rotary_emb.cos_cache.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())
    (logits,) = PagedHarness(model).prefill_logits([[1, 2, 3, 4]])
    fp32, _ = load_model(llama_checkpoint, torch.float32)
    (ref,) = PagedHarness(fp32).prefill_logits([[1, 2, 3, 4]])
    torch.testing.assert_close(logits.float(), ref, atol=5e-2, rtol=0)


def test_legacy_inv_freq_tensors_are_ignored(tmp_path, llama_checkpoint):
    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    legacy, _ = load_model(derive_checkpoint(llama_checkpoint, tmp_path / "c", edit_tensors=add))
    plain, _ = load_model(llama_checkpoint)
    assert not any("inv_freq" in name for name, _ in legacy.named_parameters())
    state, ref = _state(legacy), _state(plain)
    assert state.keys() == ref.keys()
    assert all(torch.equal(state[k], ref[k]) for k in ref)


# -- bad checkpoints: each error names the file and the tensor --------------------------------


def _expect_error(path, *patterns: str):
    with pytest.raises(ValueError) as info:
        load_model(path, torch.float32)
    msg = str(info.value)
    for pat in patterns:
        assert re.search(pat, msg), f"{pat!r} not in: {msg}"
    return msg


def test_unknown_architecture(tmp_path, llama_checkpoint):
    path = derive_checkpoint(
        llama_checkpoint,
        tmp_path / "c",
        edit_config=lambda c: c.update(architectures=["GPTJForCausalLM"]),
    )
    _expect_error(path, r"config\.json", "GPTJForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM")


def test_missing_tensor(tmp_path, llama_checkpoint):
    path = derive_checkpoint(
        llama_checkpoint,
        tmp_path / "c",
        edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
    )
    err = _expect_error(
        path, r"model\.safetensors", "missing tensor", r"model\.layers\.1\.mlp\.up_proj\.weight"
    )
    assert isinstance(CheckpointError(err), ValueError)


def test_missing_lm_head_when_not_tied(tmp_path, llama_checkpoint):
    path = derive_checkpoint(
        llama_checkpoint, tmp_path / "c", edit_tensors=lambda t: t.pop("lm_head.weight")
    )
    _expect_error(path, "missing tensor", r"'lm_head\.weight'")


def test_unexpected_tensor(tmp_path, llama_checkpoint):
    def add(t):
        t["model.layers.0.self_attn.rel_bias.weight"] = torch.zeros(4)

    path = derive_checkpoint(llama_checkpoint, tmp_path / "c", edit_tensors=add)
    _expect_error(
        path,
        r"model\.safetensors",
        "unexpected tensor",
        r"model\.layers\.0\.self_attn\.rel_bias\.weight",
    )


def test_shape_mismatch(tmp_path, llama_checkpoint):
    def bad(t):
        t[Q_PROJ] = torch.zeros(60, 64)

    path = derive_checkpoint(llama_checkpoint, tmp_path / "c", edit_tensors=bad)
    _expect_error(
        path, r"model\.safetensors", re.escape(Q_PROJ), r"shape \[60, 64\]", r"expected \[64, 64\]"
    )


@pytest.mark.parametrize("dtype,name", [(torch.int32, "I32"), (torch.float8_e4m3fn, "F8_E4M3")])
def test_unsupported_dtype(tmp_path, llama_checkpoint, dtype, name):
    def bad(t):
        t[Q_PROJ] = t[Q_PROJ].to(dtype)

    path = derive_checkpoint(llama_checkpoint, tmp_path / "c", edit_tensors=bad)
    _expect_error(path, r"model\.safetensors", re.escape(Q_PROJ), f"dtype {name}", "float")


def test_missing_shard(tmp_path):
    path = build_sharded_checkpoint(tmp_path / "s", "llama")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    _expect_error(path, re.escape(shard.name), "shard missing", r"index")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_shard(tmp_path, damage):
    path = build_sharded_checkpoint(tmp_path / "s", "llama")
    shard = sorted(path.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(b"\x00garbage" * 10 if damage == "garbage" else data[: len(data) // 2])
    _expect_error(path, re.escape(shard.name), "corrupt or truncated")


def test_index_lists_tensor_absent_from_its_shard(tmp_path):
    path = build_sharded_checkpoint(tmp_path / "s", "llama")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first_shard = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["lm_head.weight"] = first_shard  # it is really in another shard
    index_file.write_text(json.dumps(index))
    _expect_error(path, re.escape(first_shard), r"'lm_head\.weight'", "not stored")


def test_unreadable_index(tmp_path):
    path = build_sharded_checkpoint(tmp_path / "s", "llama")
    (path / "model.safetensors.index.json").write_text("{oops")
    _expect_error(path, r"model\.safetensors\.index\.json", "cannot read")


def test_unreadable_config_json(tmp_path, llama_checkpoint):
    path = derive_checkpoint(llama_checkpoint, tmp_path / "c")
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    _expect_error(path, r"config\.json", "cannot read")


def test_pickle_only_checkpoint_is_refused_without_opening_it(tmp_path, llama_checkpoint):
    path = derive_checkpoint(llama_checkpoint, tmp_path / "c")
    (path / "model.safetensors").unlink()
    # Not a valid pickle either: the loader must refuse by name, never unpickle.
    (path / "pytorch_model.bin").write_bytes(b"not a pickle")
    _expect_error(path, r"pytorch_model\.bin", "never loads pickles", "safetensors")


def test_folder_without_weights(tmp_path, llama_checkpoint):
    path = derive_checkpoint(llama_checkpoint, tmp_path / "c")
    (path / "model.safetensors").rename(path / "weights.safetensors")
    _expect_error(path, r"no model\.safetensors", r"weights\.safetensors")


def test_tensors_stored_as_held_are_mapped_not_read(llama_checkpoint):
    """A checkpoint tensor in the parameter's dtype and layout becomes a private map of the
    file (no read, no copy); merged projections and cast tensors are read; replacing a mapped
    parameter (quantization, re-layout) releases its map; writes never reach the file."""
    import gc

    from mapped import address_mapped, file_backed
    from safetensors.torch import load_file

    file = llama_checkpoint / "model.safetensors"
    hf = load_file(str(file))
    model, _ = load_model(llama_checkpoint, torch.float32)
    layer = model.model.layers[0]
    emb = model.model.embed_tokens.weight
    assert file_backed(emb, file) and file_backed(layer.self_attn.o_proj.weight, file)
    assert file_backed(layer.input_layernorm.weight, file)
    assert not file_backed(layer.self_attn.qkv_proj.weight, file)  # q, k, v: merged rows
    assert torch.equal(emb, hf["model.embed_tokens.weight"])
    assert torch.equal(layer.mlp.down_proj.weight, hf["model.layers.0.mlp.down_proj.weight"])
    cast, _ = load_model(llama_checkpoint, torch.bfloat16)
    assert not file_backed(cast.model.embed_tokens.weight, file)
    emb.data.add_(1.0)  # copy on write: the file keeps its bytes
    assert torch.equal(
        load_file(str(file))["model.embed_tokens.weight"], hf["model.embed_tokens.weight"]
    )
    o_proj = layer.self_attn.o_proj
    ptr = o_proj.weight.data_ptr()
    del o_proj.weight
    o_proj.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    gc.collect()
    assert not address_mapped(ptr, file)


def test_a_target_off_the_host_is_read_through_host_memory_never_mapped(llama_checkpoint):
    """A parameter on a device (CUDA on the GPU machine; ``meta`` stands in here) is never
    replaced by a map of the file -- that would move it to the host -- and its bytes are
    read into a host buffer and copied over, not read through a numpy view of device memory
    (the GPU check found both: the CPU-only paths failed on the first CUDA load)."""
    from models.loader import _data_offsets, _map_whole, _read_into

    file = llama_checkpoint / "model.safetensors"
    offsets = _data_offsets(file)
    span = offsets["model.embed_tokens.weight"]
    numel = (span[1] - span[0]) // 4
    with open(file, "rb", buffering=0) as raw:
        on_host = torch.empty(numel, dtype=torch.float32)
        assert _map_whole(raw, span, torch.float32, on_host) is not None
        off_host = torch.empty(numel, dtype=torch.float32, device="meta")
        assert _map_whole(raw, span, torch.float32, off_host) is None
        _read_into(raw, span, torch.float32, off_host)
        # and through the cast path (the fp32 file into a bf16 parameter):
        _read_into(raw, span, torch.float32, torch.empty(numel, device="meta").to(torch.bfloat16))
