"""The processed-weights cache: a second preparation of the same model maps the file the first
wrote (tensors backed by the file's pages, nothing read or copied), equal to computing them;
a changed checkpoint, quantization or kernel setting is another key; a corrupted or
truncated file is one warning naming it and the weights are recomputed; a full disk is one
warning and the model still comes back; what cannot be described is not cached."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import struct
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from mapped import file_backed

from framework.cache.module_state import NotCacheable, describe, restore, snapshot
from framework.cache.store import CacheCorruptionWarning, CacheWriteWarning
from framework.cache.weights import map_safetensors, read_header, write_safetensors
from framework.core.config import CompilationConfig, KernelConfig
from framework.core.page_cache import evict, file_resident_fraction
from framework.engine.model_prep import prepare_model
from models.loader import build_model
from passes.registry import level_passes
from tests.disk_faults import refuse_writes


def config_for(cache_dir, **kernel) -> CompilationConfig:
    cc = CompilationConfig(level=2, cache_dir=str(cache_dir), kernel_config=KernelConfig(**kernel))
    return cc.resolve(max_num_tokens=64, level_passes=level_passes, has_cuda=False)


@pytest.fixture()
def ckpt(llama_checkpoint, tmp_path) -> Path:
    """A private copy of the tiny llama checkpoint (its own mtime: its own cache keys)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(llama_checkpoint, dst)
    return dst


def tensors_of(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def assert_same_model(a: nn.Module, b: nn.Module) -> None:
    assert describe(a) == describe(b)
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    for (name, ma), (_, mb) in zip(a.named_modules(), b.named_modules()):
        assert repr(getattr(ma, "linear_method", None)) == repr(
            getattr(mb, "linear_method", None)
        ), name


@pytest.mark.parametrize("quant", [None, "int8_per_token"], ids=["bf16", "int8"])
def test_second_preparation_maps_the_file_the_first_wrote(ckpt, tmp_path, quant):
    config = config_for(tmp_path / "cache")
    first = prepare_model(str(ckpt), torch.bfloat16, "cpu", quant, config)
    assert first.weights_cache == "written" and (first.packed_layers or first.quantized[2])
    second = prepare_model(str(ckpt), torch.bfloat16, "cpu", quant, config)
    assert second.weights_cache == "hit"
    assert second.weights_path == first.weights_path
    assert second.packed_layers == first.packed_layers
    assert second.quantized[1] == first.quantized[1]
    assert second.quantized[2] == first.quantized[2]
    assert_same_model(second.model, first.model)
    # Every tensor of the warm model is a view of the one mapped file: nothing was copied.
    for name, t in tensors_of(second.model).items():
        assert file_backed(t, second.weights_path), name
    assert not any(file_backed(t, second.weights_path) for t in tensors_of(first.model).values())
    qkv = second.model.model.layers[0].self_attn.qkv_proj
    cold_qkv = first.model.model.layers[0].self_attn.qkv_proj
    assert type(qkv.linear_method) is type(cold_qkv.linear_method)
    assert vars(qkv.linear_method).keys() == vars(cold_qkv.linear_method).keys()
    if quant:  # whatever layout the scheme chose, its weight is not the float one
        assert qkv.weight.dtype != torch.bfloat16
    # The file is a plain safetensors file: safetensors itself reads it.
    from safetensors import safe_open

    with safe_open(second.weights_path, framework="pt") as f:
        assert len([k for k in f.keys() if not k.startswith("__pad")]) == len(
            {id(t) for t in tensors_of(second.model).values()}
        )


def test_a_hit_reports_how_much_of_the_file_the_page_cache_held(ckpt, tmp_path):
    """Measured before the mapping is touched: 0 after the file was evicted (then a thread
    reads it back in while the start goes on), 1 once a start has touched every page."""
    config = config_for(tmp_path / "cache")
    first = prepare_model(str(ckpt), torch.bfloat16, "cpu", None, config)
    assert first.weights_cache == "written" and first.page_cache_frac is None
    evict(first.weights_path)
    evicted = prepare_model(str(ckpt), torch.bfloat16, "cpu", None, config)
    assert evicted.weights_cache == "hit"
    if evicted.page_cache_frac != 0.0:
        pytest.skip(f"{tmp_path}: this filesystem keeps pages after DONTNEED")
    # Nothing touched the mapping, yet a thread reads the file in (front to back, while the
    # start goes on): the warm-up forward then finds it in memory.
    deadline = time.monotonic() + 30
    while file_resident_fraction(evicted.weights_path) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert file_resident_fraction(evicted.weights_path) == 1.0
    evict(first.weights_path)
    for t in tensors_of(evicted.model).values():  # what a warm-up forward does
        t.float().sum()
    touched = prepare_model(str(ckpt), torch.bfloat16, "cpu", None, config)
    assert touched.weights_cache == "hit" and touched.page_cache_frac == 1.0


def test_changed_checkpoint_quantization_or_kernel_config_is_another_entry(ckpt, tmp_path):
    root = tmp_path / "cache"
    config = config_for(root)
    base = prepare_model(str(ckpt), torch.bfloat16, "cpu", None, config)
    assert base.weights_cache == "written"
    other_kernel = prepare_model(
        str(ckpt), torch.bfloat16, "cpu", None, config_for(root, small_m_max_rows=8)
    )
    assert other_kernel.weights_cache == "written"
    assert other_kernel.weights_path != base.weights_path
    layer = other_kernel.model.model.layers[0].self_attn.qkv_proj
    assert layer.linear_method.max_rows == 8
    quant = prepare_model(str(ckpt), torch.bfloat16, "cpu", "int8_per_channel_weight_only", config)
    assert quant.weights_cache == "written" and quant.weights_path not in (
        base.weights_path,
        other_kernel.weights_path,
    )
    # The first configurations still hit.
    again = prepare_model(
        str(ckpt), torch.bfloat16, "cpu", None, config_for(root, small_m_max_rows=8)
    )
    assert again.weights_cache == "hit"
    # Rewrite one tensor of the checkpoint: the old entry must not be used.
    _scale_tensor(ckpt / "model.safetensors", "model.embed_tokens.weight", 2.0)
    changed = prepare_model(str(ckpt), torch.bfloat16, "cpu", None, config)
    assert changed.weights_cache == "written" and changed.weights_path != base.weights_path
    emb_old = base.model.model.embed_tokens.weight
    emb_new = changed.model.model.embed_tokens.weight
    assert torch.equal(emb_new, (emb_old.float() * 2).to(torch.bfloat16))


def _scale_tensor(file: Path, name: str, factor: float) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    tensors[name] = tensors[name] * factor
    tmp = file.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(file)


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_corrupted_file_is_recomputed_with_a_warning_naming_it(ckpt, tmp_path, damage):
    config = config_for(tmp_path / "cache")
    first = prepare_model(str(ckpt), torch.bfloat16, "cpu", None, config)
    path = Path(first.weights_path)
    _, base, _ = read_header(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        if damage == "flip":
            f.seek(base + (size - base) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        elif damage == "truncate":
            f.truncate(size - 4096)
        else:
            f.seek(8)
            f.write(b"#")
    with pytest.warns(CacheCorruptionWarning, match=str(path)):
        again = prepare_model(str(ckpt), torch.bfloat16, "cpu", None, config)
    assert again.weights_cache == "corrupt"
    assert_same_model(again.model, first.model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheCorruptionWarning)
        third = prepare_model(str(ckpt), torch.bfloat16, "cpu", None, config)
    assert third.weights_cache == "hit"
    assert_same_model(third.model, first.model)


@pytest.mark.parametrize("when", ["probe", "write", "mid_file"])
def test_a_full_disk_is_one_warning_and_the_model_still_loads(
    ckpt, tmp_path, monkeypatch, caplog, when
):
    """Refused at the probe (a full or read-only root): one log line, no second warning
    beside the compile store's; refused while writing the file (at its start, or by the OS
    after the first 100 KB were written: the partial file is removed): the store's one
    CacheWriteWarning.  Either way the model comes back, computed."""
    root = tmp_path / "cache"
    config = config_for(root)
    reference = prepare_model(str(ckpt), torch.bfloat16, "cpu", None, config_for(tmp_path / "ok"))
    root.mkdir()
    if when == "probe":
        refuse_writes(monkeypatch, root, errno.ENOSPC)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheWriteWarning)
            got = prepare_model(str(ckpt), torch.bfloat16, "cpu", None, config)
        assert "processed weights not cached" in caplog.text and str(root) in caplog.text
    else:
        import framework.cache.weights as weights

        def full(path, tensors, metadata):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        real_write, room = os.write, [100 << 10]

        def filling(fd, data):  # the disk takes 100 KB, then is full
            if room[0] <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = real_write(fd, memoryview(data)[: room[0]])
            room[0] -= n
            return n

        if when == "write":
            monkeypatch.setattr(weights, "write_safetensors", full)
        else:
            monkeypatch.setattr(weights.os, "write", filling)
        with pytest.warns(CacheWriteWarning, match="No space left"):
            got = prepare_model(str(ckpt), torch.bfloat16, "cpu", None, config)
        assert not list(root.rglob("*.bin")) and not list(root.rglob(".tmp-*"))
        assert when == "write" or room[0] <= 0  # the disk did fill mid-file
    assert got.weights_cache == "miss" and got.weights_path is None
    assert_same_model(got.model, reference.model)


def test_no_cache_when_the_cache_is_off(ckpt, tmp_path):
    config = config_for(tmp_path / "cache").replace(cache_weights=False)
    got = prepare_model(str(ckpt), torch.bfloat16, "cpu", None, config)
    assert got.weights_cache == "off" and not (tmp_path / "cache").exists()


# ----------------------------------------------------------------------------- the pieces
def test_file_format_round_trip_is_aligned_and_mapped(tmp_path):
    tensors = {
        "a": torch.arange(7, dtype=torch.int8),
        "b": torch.randn(3, 5).to(torch.bfloat16),
        "c": torch.randn(2, 2, 3),
        "d": torch.tensor(True),
        "e": torch.empty(0, 4),
    }
    path = tmp_path / "w.safetensors"
    write_safetensors(path, tensors, {"k": "v"})
    got, meta = map_safetensors(path)
    assert meta == {"k": "v"} and got.keys() == tensors.keys()
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        assert got[name].data_ptr() % 64 == 0 or t.numel() == 0, name
    assert file_backed(got["c"], path)
    got["c"].zero_()  # a private map: the file is untouched
    again, _ = map_safetensors(path)
    assert torch.equal(again["c"], tensors["c"])
    header = json.loads(path.read_bytes()[8 : 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    assert header["__metadata__"] == {"k": "v"}


def test_large_tensors_lie_on_huge_page_boundaries_and_map_as_huge_pages(tmp_path):
    """Tensors of 2 MB or more start on 2 MB boundaries of the file (the rest 64-byte aligned),
    safetensors itself still reads the file, and the map is advised MADV_HUGEPAGE: where the
    page cache holds the file in 2 MB folios (a Linux 6.x ext4/xfs page cache, as written
    here) the big tensors map as huge pages."""
    from safetensors.torch import load_file

    from framework.core.huge_pages import HUGE_PAGE, page_backing, thp_mode

    tensors = {
        "small": torch.randn(3, 5).to(torch.bfloat16),
        "big": torch.randn(2048, 1536),  # 12 MB
        "odd": torch.arange(11, dtype=torch.int8),
        "big2": torch.randn(1024, 1025).to(torch.bfloat16),  # just over 2 MB
    }
    path = tmp_path / "w.safetensors"
    write_safetensors(path, tensors, {"k": "v"})
    header, base, _ = read_header(path)
    for name, t in tensors.items():
        start = base + header[name]["data_offsets"][0]
        big = t.numel() * t.element_size() >= HUGE_PAGE
        assert start % (HUGE_PAGE if big else 64) == 0, name
    plain = load_file(str(path))
    got, meta = map_safetensors(path)
    assert meta == {"k": "v"}
    for name, t in tensors.items():
        assert torch.equal(got[name], t) and torch.equal(plain[name], t), name
    backing = page_backing(got["big"])
    assert backing.rss >= 12 << 20 or backing.rss == 0  # touched above (or no /proc)
    with open("/proc/self/mounts") as f:
        mounts = [line.split() for line in f]
    fs = max((m for m in mounts if str(path).startswith(m[1])), key=lambda m: len(m[1]))[2]
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    if fs == "ext4" and thp_mode() is not None and release >= (6, 16):
        assert backing.file_pmd >= HUGE_PAGE, backing  # at least one 2 MB block mapped huge


class _Foreign:
    __slots__ = ("x",)


def test_state_that_cannot_be_described_is_not_cached(llama_checkpoint):
    model, _ = build_model(llama_checkpoint, torch.float32)
    fresh, _ = build_model(llama_checkpoint, torch.float32)
    model._apply(lambda t: torch.zeros(t.shape, dtype=t.dtype))
    model.model.layers[0].mlp.note = _Foreign()
    with pytest.raises(NotCacheable, match="layers.0.mlp.note"):
        snapshot(model, fresh)
    del model.model.layers[0].mlp.note
    model.model.layers[0].mlp.add_module("extra", nn.Identity())
    with pytest.raises(NotCacheable, match="module tree"):
        snapshot(model, fresh)


def test_snapshot_restores_attributes_buffers_and_ties(tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen2")  # tied embeddings, qkv bias
    model, _ = build_model(ckpt, torch.float32)
    model._apply(lambda t: torch.randn(t.shape).to(t.dtype))
    model.init_non_persistent_state()
    layer = model.model.layers[1].self_attn.o_proj
    w = layer.weight
    del layer.weight
    layer.weight = nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False)
    layer.register_buffer("scale_note", torch.ones(3), persistent=False)
    layer.counter = {"calls": (1, 2.5, None), "dtype": torch.bfloat16}
    fresh, _ = build_model(ckpt, torch.float32)
    tensors, state = snapshot(model, fresh)
    json.dumps(state)  # plain data
    restore(fresh, tensors, state)
    assert describe(fresh) == describe(model)
    restored = fresh.model.layers[1].self_attn.o_proj
    assert restored.counter == layer.counter
    assert "scale_note" in restored._non_persistent_buffers_set
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight


def test_the_file_is_written_in_pieces_ending_on_huge_page_boundaries(tmp_path, monkeypatch):
    """Every ``write`` but the last ends on a 2 MB boundary of the file (small tensors gathered,
    a large one straight from its memory), however little the OS takes per call; the file
    reads back the same."""
    from framework.cache import weights
    from framework.core.huge_pages import HUGE_PAGE

    asked: list[int] = []  # where each call asked to stop writing (file offset)
    real_write = os.write
    written = 0

    def stingy_write(fd, data):  # the OS may take less than asked
        nonlocal written
        asked.append(written + len(memoryview(data)))
        n = real_write(fd, memoryview(data)[: 1536 << 10])
        written += n
        return n

    tensors = {f"small{i}": torch.full((50_000,), i, dtype=torch.int8) for i in range(50)}
    tensors["big"] = torch.randn(1024, 2048)  # 8 MB, 2 MB aligned
    tensors["tail"] = torch.arange(1000, dtype=torch.int16)
    path = tmp_path / "w.safetensors"
    monkeypatch.setattr(weights.os, "write", stingy_write)
    write_safetensors(path, tensors, {"k": "v"})
    monkeypatch.undo()
    size = path.stat().st_size
    assert written == size and len(asked) > size // (1536 << 10)
    assert all(end % HUGE_PAGE == 0 or end == size for end in asked), asked
    got, _ = map_safetensors(path)
    assert all(torch.equal(got[n], t) for n, t in tensors.items())


def test_small_tensors_map_as_huge_pages_too(tmp_path):
    """A file of small tensors only (2.5 MB of 50 KB ones), written and mapped here: where the
    page cache builds folios as large as the writes (ext4 since Linux 6.16), its first 2 MB
    map as one huge page -- written tensor by tensor they lay in small folios."""
    from framework.core.huge_pages import HUGE_PAGE, page_backing, thp_mode

    with open("/proc/self/mounts") as f:
        mounts = [line.split() for line in f]
    fs = max((m for m in mounts if str(tmp_path).startswith(m[1])), key=lambda m: len(m[1]))[2]
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    if not (fs == "ext4" and thp_mode() in ("madvise", "always") and release >= (6, 16)):
        pytest.skip(f"{fs} on Linux {os.uname().release}, THP {thp_mode()}: no large folios")
    tensors = {f"w{i}": torch.full((25_000,), i, dtype=torch.bfloat16) for i in range(50)}
    path = tmp_path / "w.safetensors"
    write_safetensors(path, tensors, {"k": "v"})
    got, _ = map_safetensors(path)
    assert all(torch.equal(got[n], t) for n, t in tensors.items())
    assert page_backing(list(got.values())).file_pmd >= HUGE_PAGE


def test_a_sweep_by_another_start_does_not_fail_the_write_probe(tmp_path, monkeypatch):
    """Two cold starts of one model: one holds the store's writer lock and sweeps the folder's
    temp files (lock held: every ``.tmp-*`` goes) while the other's write probe, written
    before it takes that lock, lies between its write and its removal.  The write worked: the
    folder is writable, not an error (CI once failed here with FileNotFoundError)."""
    from framework.cache import weights
    from framework.core.files import sweep_stale_temps

    cache = weights.WeightCache(tmp_path, {"tensor_parallel": {"rank": 0}}, "model")
    real_open = open

    @contextlib.contextmanager
    def open_then_swept(path, mode="r"):
        with real_open(path, mode) as f:
            yield f
        assert sweep_stale_temps(Path(path).parent, lock_held=True) == 1

    monkeypatch.setattr(weights, "open", open_then_swept, raising=False)
    assert cache._writable()
    assert list(cache.dir.iterdir()) == []
