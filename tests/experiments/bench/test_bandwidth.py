"""The native read-bandwidth probe (experiments/bench/bandwidth.py, csrc/read_bandwidth.cpp): every
method reads every byte of its buffer (the kernel's sum of the buffer's words is checked), in
both page sizes, and the floor falls back to torch.sum only without a compiler."""

from __future__ import annotations

import pytest

from experiments.bench import bandwidth

needs_probe = pytest.mark.skipif(
    not bandwidth.probe_available(), reason="no C++ compiler to build the probe"
)


@needs_probe
@pytest.mark.parametrize("method", bandwidth.METHODS)
@pytest.mark.parametrize("huge", [True, False])
def test_every_method_reads_every_byte(method, huge):
    row = bandwidth.read_once(
        (8 << 20) + 4096 + 100, threads=2, repeats=2, method=method, huge_pages=huge
    )
    # rounded down to whole units of 4 streams x 128 bytes, the checked sum matched
    assert row["bytes"] == (8 << 20) + 4096
    assert len(row["seconds"]) == 2 and all(t > 0 for t in row["seconds"])
    assert row["best_gb_s"] >= row["median_gb_s"] > 0


@needs_probe
def test_probe_reports_the_best_case_and_odd_thread_counts_work():
    probe = bandwidth.probe_read_bandwidth(megabytes=4, repeats=2, threads=3)
    assert len(probe["rows"]) == 2 * len(bandwidth.METHODS)
    assert probe["best_gb_s"] == max(r["best_gb_s"] for r in probe["rows"])
    assert probe["threads"] == 3 and probe["isa"] in ("avx512", "portable")
    assert "best:" in bandwidth.format_probe(probe)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="method"):
        bandwidth.read_once(1 << 20, threads=1, repeats=1, method="fast")
    with pytest.raises(ValueError, match="positive"):
        bandwidth.read_once(0, threads=1, repeats=1)


def test_floor_without_a_compiler_is_torch_sum(monkeypatch):
    monkeypatch.setattr(bandwidth, "probe_available", lambda: False)
    bw, how = bandwidth.floor_bandwidth(megabytes=8, repeats=2)
    assert bw > 0 and how["probe"].startswith("torch.sum")


@needs_probe
def test_reading_existing_tensors_covers_their_bytes():
    import torch

    ts = [torch.ones(1000, dtype=torch.bfloat16), torch.zeros(3, 777), torch.ones(5)[1:]]
    row = bandwidth.read_tensors(ts, threads=2, repeats=2, method="stream")
    # every storage once (the view's whole storage), tails included
    assert row["bytes"] == 2000 + 4 * 3 * 777 + 4 * 5 and row["buffers"] == 3
    assert row["best_gb_s"] > 0
    with pytest.raises(ValueError, match="no CPU tensor"):
        bandwidth.read_tensors([torch.empty(0)])


@needs_probe
@pytest.mark.parametrize("method", bandwidth.METHODS)
def test_reading_a_tensor_reads_its_words_and_tail(method):
    import torch

    t = torch.arange(64 * 10 + 7, dtype=torch.int64)  # 10 units of 512 bytes + a 56-byte tail
    row = bandwidth.read_tensors([t], threads=3, repeats=1, method=method)
    tail = t[640:].view(torch.uint8).to(torch.int64).sum().item()
    assert row["sum"] == t[:640].sum().item() + tail
