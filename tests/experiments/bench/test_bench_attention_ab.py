"""The side-by-side attention bench: two builds of the kernel, alternated on one step's tensors."""

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments.bench import attention_ab
from experiments.bench.attention import Case

REPO = Path(attention_ab.__file__).resolve().parents[2]


def test_baseline_source_from_a_file_and_from_a_git_revision(tmp_path):
    current = REPO / attention_ab.SOURCE
    assert attention_ab.baseline_source(str(current), tmp_path, REPO) == current
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(
        ["git", "show", f"HEAD:{attention_ab.SOURCE}"], cwd=REPO, capture_output=True, text=True
    )
    if head.returncode:
        pytest.skip("the kernel source is not committed in this checkout")
    got = attention_ab.baseline_source("HEAD", tmp_path, REPO)
    assert got.read_text() == head.stdout


def test_a_bad_baseline_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="no-such-revision"):
        attention_ab.baseline_source("no-such-revision", tmp_path, REPO)


def test_two_builds_alternate_and_report_ratios_and_bits(tmp_path):
    """A second build of the same source (another library name, loaded beside the first)
    gives the same bits; a source whose softmax is changed does not."""
    from backends.attention.cpu_paged_build import LIBRARY, declare_attention
    from framework.core.native_build import NativeLibrary

    def build(name: str, text: str):
        src = tmp_path / name / "cpu_paged_attention.cpp"
        src.parent.mkdir()
        src.write_text(text)
        return NativeLibrary(
            f"cpu_paged_test_{name}",
            src,
            portable_env="PIECEWISE_CPU_PAGED_PORTABLE",
            declare=declare_attention,
        ).load(None)

    text = LIBRARY.source.read_text()
    same = build("same", text)
    # a softmax 1% sharper (the entry point's scale, which every path reads): other outputs
    marker = "hq, hkv, d, scale, window};"
    assert text.count(marker) == 1
    other = build("other", text.replace(marker, "hq, hkv, d, scale * 1.01f, window};"))
    cases = (
        Case("decode b2 ctx 40", (40, 17), (1, 1)),
        dataclasses.replace(attention_ab.AB_CASES[-1], ctx_lens=(24,), q_lens=(24,)),
    )
    libs = {"baseline": LIBRARY.load(None), "current": same, "other": other}
    rows = attention_ab.run(libs, cases, rounds=2, calls=2, evict_mb=1)
    assert [r["case"] for r in rows] == [c.name for c in cases]
    for r in rows:
        for n in libs:
            assert r[f"{n}_hot_us"] > 0 and r[f"{n}_cold_us"] > 0
        assert r["current_over_baseline_hot"] == pytest.approx(
            r["current_hot_us"] / r["baseline_hot_us"]
        )
        assert r["same_bits"] is False  # "other" differs from the baseline
    pair = attention_ab.run(
        {"baseline": LIBRARY.load(None), "current": same}, cases, rounds=1, calls=1, evict_mb=1
    )
    assert all(r["same_bits"] for r in pair)
    table = attention_ab.format_table(pair, "baseline", "current")
    assert table.count("\n") == 1 + len(cases) and "| yes |" in table
