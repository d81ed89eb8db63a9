"""The peer benchmark (experiments/bench/peers.py, experiments/bench/peer_worker.py): the
worker's token check gates timing, the orchestrator alternates fresh processes, appends each
result at once and resumes, and the summary / ratios / floors / targets come out of the
rounds.  The real llama.cpp and CTranslate2 runs need the optional ``peers`` extra and are
skipped without it."""

from __future__ import annotations

import json
import time

import pytest
import torch
from onednn_panels import has_amx

from experiments.bench import peer_worker as peers
from experiments.bench import peers as bench_peers


class _FakeRunner(peers.Runner):
    """Tokens 0..n-1 (+ offset per prompt); each generation sleeps 1 ms per token."""

    def __init__(self):
        self.prepared = []

    def prepare(self, batch):
        self.prepared.append(batch)

    def generate(self, prompts, n):
        time.sleep(n * 1e-3)
        return [[i + s for i in range(n)] for s in range(len(prompts))]


def _job(contender, reference=None, **kw):
    return (
        dict(
            contender=contender,
            size="tiny",
            batches=[1, 2],
            prompts={"1": [[5] * 4], "2": [[5] * 4, [6] * 4]},
            prompt_len=4,
            new_tokens=[2, 10],
            check_tokens=6,
            reps=2,
            threads=1,
            reference=reference,
        )
        | kw
    )


def test_first_divergence():
    assert peers.first_divergence([[1, 2, 3]], [[1, 2, 3]]) is None
    assert peers.first_divergence([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == 1
    assert peers.first_divergence([[1, 2]], [[1, 2, 3]]) == 2  # too short


def test_exact_contender_with_other_tokens_is_reported_not_timed(monkeypatch):
    fake = _FakeRunner()
    monkeypatch.setattr(peers, "build_runner", lambda job: fake)
    good = {"1": [list(range(6))], "2": [list(range(6)), list(range(1, 7))]}
    bad = {"1": [[0, 1, 2, 99, 4, 5]], "2": good["2"]}
    res = peers.run_job(_job("llamacpp_bf16", bad))
    assert fake.prepared == [1, 2]
    b1, b2 = res["batches"]["1"], res["batches"]["2"]
    assert (b1["timed"], b1["first_divergence"], b1["tokens_match"]) == (False, 3, False)
    assert "step 3" in b1["why_not_timed"] and "step_ms" not in b1
    assert b2["timed"] and b2["tokens_match"] and b2["step_ms"] > 0.5  # ~1 ms per token
    assert len(b2["t_long_s"]) == 2 and res["rss_end"]["VmHWM"] > 0
    # a quantized contender is timed anyway, its divergence reported
    q = peers.run_job(_job("llamacpp_q8_0", bad))["batches"]["1"]
    assert q["timed"] and q["first_divergence"] == 3
    # a preparation run (the reference) only generates the tokens
    prep = peers.run_job(_job("project_bf16", None, prepare=True))["batches"]["1"]
    assert not prep["timed"] and prep["tokens"] == [list(range(6))]


def test_evict_drops_the_weight_files_before_the_load(monkeypatch, tmp_path):
    """``peers --evict``: the worker drops its contender's files from the page cache first
    and records what the page cache held of them (its load is then the disk's)."""
    monkeypatch.setattr(peers, "build_runner", lambda job: _FakeRunner())
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\1" * (1 << 20))
    kept = peers.run_job(_job("llamacpp_bf16", None, gguf=str(gguf), reps=0))
    assert kept["page_cache_before_load"] == {"files": {"model.gguf": 1.0}, "fraction": 1.0}
    res = peers.run_job(_job("llamacpp_bf16", None, gguf=str(gguf), reps=0, evict=True))
    if res["page_cache_before_load"]["fraction"] != 0.0:
        pytest.skip(f"{tmp_path}: this filesystem keeps pages after DONTNEED")
    assert res["to_first_tokens_s"] >= res["start_s"] > 0


def test_a_late_bf16_divergence_is_timed_and_reported_per_sequence(monkeypatch):
    """Two correct bf16 engines part where near-tied logits meet rounding: the median sequence
    decides (a misconfigured engine parts on every sequence within a step or two)."""
    assert peers.agrees_enough([None, 12, 2], 8) and not peers.agrees_enough([2, 1, None], 8)
    assert peers.divergence_steps([[1, 2], [3]], [[1, 2], [3, 4], [5]]) == [None, 1, 0]
    monkeypatch.setattr(peers, "build_runner", lambda job: _FakeRunner())
    same = {"1": [list(range(10))], "2": [list(range(10)), list(range(1, 11))]}
    res = peers.run_job(_job("llamacpp_bf16", same, check_tokens=10, min_identical=8))
    assert all(b["timed"] and b["tokens_match"] for b in res["batches"].values())
    late = {"1": [list(range(9)) + [99]], "2": [[0, 99] + list(range(2, 10)), same["2"][1]]}
    res = peers.run_job(_job("llamacpp_bf16", late, check_tokens=10, min_identical=8))
    b1, b2 = res["batches"]["1"], res["batches"]["2"]
    assert b1["timed"] and b1["divergence_steps"] == [9] and b1["first_divergence"] == 9
    # one of two sequences parts at step 1: the median (the upper one of two) agrees
    assert b2["timed"] and b2["divergence_steps"] == [1, None] and b2["first_divergence"] == 1
    res = peers.run_job(_job("llamacpp_bf16", late, check_tokens=10, min_identical=10))
    assert (
        not res["batches"]["1"]["timed"]
        and "per sequence: [9]" in (res["batches"]["1"]["why_not_timed"])
    )


def test_streamed_bytes_counts_every_weight_but_the_embedding(llama_checkpoint):
    from safetensors.torch import load_file

    sd = load_file(str(llama_checkpoint / "model.safetensors"))
    got = bench_peers.streamed_bytes(llama_checkpoint)
    rest = [t for n, t in sd.items() if n != "model.embed_tokens.weight"]
    assert got["bf16"] == 2 * sum(t.numel() for t in rest)
    assert got["q8_0"] == sum(t.numel() * 34 // 32 if t.dim() == 2 else 4 * t.numel() for t in rest)


def _fake_process(steps_ms):
    """A runner(job, env, timeout) standing in for a worker process: per contender a list of
    step times, one per call; records the calls."""
    calls = []

    def run(job, env, timeout):
        calls.append((job["size"], job["contender"], bool(job.get("prepare"))))
        k = sum(1 for c in calls if c[1] == job["contender"] and not c[2]) - 1
        ms = steps_ms[job["contender"]]
        rows = {}
        for b in job["batches"]:
            toks = [list(range(job["check_tokens"]))] * b
            row = {"batch": b, "tokens": toks, "timed": not job.get("prepare")}
            if job.get("reference") is not None:
                row.update(tokens_match=True, first_divergence=None)
            if row["timed"]:
                row["step_ms"] = ms[k % len(ms)] * b
            row["rss_after"] = {"VmHWM": 10**9}
            rows[str(b)] = row
        return {
            "contender": job["contender"],
            "size": job["size"],
            "start_s": 1.0,
            "warm_after_torch_s": 2.0,
            "batches": rows,
            "rss_end": {"VmHWM": 2 * 10**9},
            "load": {"others_frac": 0.1, "steal_frac": 0.0},
        }

    return run, calls


def test_rounds_alternate_append_resume_and_give_the_targets(tmp_path, llama_checkpoint):
    out = tmp_path / "peers.json"
    argv = [
        "--sizes", "1.1b",
        "--model-dirs", f"1.1b={llama_checkpoint}",
        "--batches", "1", "8",
        "--contenders", "project_bf16", "project_int8", "hf_eager",
        "--rounds", "4",
        "--out", str(out),
        "--work-dir", str(tmp_path / "work"),
    ]  # fmt: skip
    run, calls = _fake_process(
        {"project_bf16": [10.0, 10.5, 11.0, 12.0], "project_int8": [5.0], "hf_eager": [30.0]}
    )

    def probe(args):
        return {"best_gb_s": 50.0, "rows": []}

    data = bench_peers.main(argv, runner=run, probe=probe)
    prep = [c for c in calls if c[2]]
    assert prep == [("1.1b", "project_bf16", True), ("1.1b", "project_int8", True)]
    timed = [c[1] for c in calls if not c[2]]
    assert len(timed) == 12
    assert timed[:3] == ["project_bf16", "project_int8", "hf_eager"]
    assert timed[3:6] == ["project_int8", "hf_eager", "project_bf16"]  # rotated
    saved = json.loads(out.read_text())
    assert len(saved["runs"]) == 12 and saved["reference"]["1.1b"]["1"] == [list(range(16))]
    # the CPU is part of the record: which kernels ran depends on it (AVX-512 or AVX2 only)
    from framework.core.native_build import cpu_flags

    flags = set(cpu_flags().split())
    assert saved["machine"]["isa"] == [f for f in bench_peers.ISA_FLAGS if f in flags]

    s = data["summary"]["1.1b/project_bf16"]["batches"]["1"]["stats"]
    assert s["median"] == 10.75 and s["spread"] == pytest.approx(12 / 10)
    by = {(r["batch"], r["ratio"]): r["speedup"] for r in data["ratios"]}
    assert by[(1, "project int8 vs project bf16")] == pytest.approx(10.75 / 5)
    assert by[(8, "project bf16 vs transformers eager bf16")] == pytest.approx(240 / 86)
    floor = data["floors"]["1.1b"]
    nbytes = bench_peers.streamed_bytes(llama_checkpoint)["bf16"]
    # the best rate: the probe's 50 GB/s or a contender's own (its best round) if higher
    best = max(50.0, nbytes / 10e-3 / 1e9, nbytes / 30e-3 / 1e9)
    assert floor["best_gb_s"] == pytest.approx(best)
    t = {x["target"]: x for x in data["targets"]}
    assert t["1.1b, b1: int8 vs bf16 inside the project"]["met"]
    spread = next(v for k, v in t.items() if k.startswith("1.1b bf16 b1 spread"))
    assert spread["got"] == pytest.approx(1.2) and not spread["met"]
    warm = t["1.1b warm LLM(...) after import torch (s)"]
    assert warm["got"] == 2.0 and warm["met"]
    assert "| 1.1b | project_bf16 | 1 | 10.75 |" in data["markdown"]

    # a rerun with the same settings only re-measures the probe; other settings start over
    calls.clear()
    bench_peers.main(argv, runner=run, probe=probe)
    assert calls == []
    bench_peers.main(argv + ["--reps", "1"], runner=run, probe=probe)
    assert len([c for c in calls if not c[2]]) == 12
    assert (tmp_path / "peers.json.old").is_file()


def test_a_failing_contender_is_recorded_and_the_rest_run(tmp_path, llama_checkpoint):
    run, calls = _fake_process({"project_bf16": [10.0], "hf_eager": [30.0]})

    def flaky(job, env, timeout):
        if job["contender"] == "hf_eager":
            raise RuntimeError("boom")
        return run(job, env, timeout)

    data = bench_peers.main(
        [
            "--sizes",
            "tiny",
            "--model-dirs",
            f"tiny={llama_checkpoint}",
            "--batches",
            "1",
            "--contenders",
            "project_bf16",
            "hf_eager",
            "--rounds",
            "2",
            "--out",
            str(tmp_path / "p.json"),
            "--work-dir",
            str(tmp_path / "w"),
        ],  # fmt: skip
        runner=flaky,
        probe=lambda args: {"error": "no probe"},
    )
    assert [f["contender"] for f in data["failures"]] == ["hf_eager", "hf_eager"]
    assert len(data["runs"]) == 2 and "boom" in data["failures"][0]["error"]


def test_missing_peer_packages_are_left_out_with_a_reason(tmp_path, llama_checkpoint, monkeypatch):
    monkeypatch.setattr(bench_peers, "have", lambda module: module != "llama_cpp")
    run, calls = _fake_process({"project_bf16": [10.0]})
    data = bench_peers.main(
        [
            "--sizes",
            "tiny",
            "--model-dirs",
            f"tiny={llama_checkpoint}",
            "--batches",
            "1",
            "--contenders",
            "project_bf16",
            "llamacpp_bf16",
            "--rounds",
            "1",
            "--out",
            str(tmp_path / "p.json"),
            "--work-dir",
            str(tmp_path / "w"),
        ],  # fmt: skip
        runner=run,
        probe=lambda args: {"error": "no probe"},
    )
    assert data["skipped"] == {"llamacpp_bf16": "not installed: llama_cpp"}
    assert {c[1] for c in calls} == {"project_bf16"}


def test_bad_arguments_are_refused():
    for argv in (["--rounds", "0"], ["--new-tokens", "8", "8"], ["--model-dirs", "huge=/x"]):
        with pytest.raises(SystemExit):
            bench_peers.parse_args(argv)


@pytest.mark.slow
@pytest.mark.parametrize(
    "peer", ["llamacpp_bf16", "llamacpp_q8_0", "llamacpp_q8_0-no-extra-bufts", "ct2_int8"]
)
def test_real_peer_matches_the_projects_tokens(tmp_path, llama_checkpoint, peer):
    """The real processes: the project (O0) makes the reference, the peer runs on the files
    written for it; bf16 must give the project's tokens, quantized peers are reported.  (On an
    AMX Xeon llama-cpp-python 0.3.36's q8_0 fails with its extra buffers on: the last llama.cpp
    case turns them off.)"""
    peer, _, option = peer.partition("-")
    extra = ["--llamacpp-no-extra-bufts"] if option else []
    for m in bench_peers.NEEDS[peer]:
        pytest.importorskip(m)
    data = bench_peers.main(
        [
            "--sizes",
            "tiny",
            "--model-dirs",
            f"tiny={llama_checkpoint}",
            "--batches",
            "1",
            "3",
            "--contenders",
            "project_bf16",
            peer,
            "--rounds",
            "1",
            "--reps",
            "3",  # best of 3: one pair of runs under load can time the short one longer
            "--prompt-len",
            "8",
            "--new-tokens",
            "2",
            "6",
            "--check-tokens",
            "8",
            "--level",
            "0",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "p.json"),
            "--work-dir",
            str(tmp_path / "w"),
        ]  # fmt: skip
        + extra,
        probe=lambda args: {"error": "no probe"},
    )
    if peer == "llamacpp_q8_0" and not option and has_amx() and data.get("failures"):
        pytest.xfail(f"llama.cpp q8_0 with its AMX buffers: {data['failures'][0]['error'][-300:]}")
    assert not data.get("failures"), data.get("failures")
    run = next(r for r in data["runs"] if r["contender"] == peer)
    for b in ("1", "3"):
        row = run["batches"][b]
        if peer in peers.EXACT:
            assert row["tokens_match"], (b, row["tokens"], data["reference"]["tiny"][b])
        assert row["timed"] and row["step_ms"] > 0
    assert torch.tensor(run["batches"]["3"]["tokens"]).shape == (3, 8)
    # its weight files' share in the page cache before the load, and the time to first tokens
    held = run["page_cache_before_load"]
    assert held["files"] and 0.0 <= held["fraction"] <= 1.0
    assert run["to_first_tokens_s"] > run["start_s"]


def test_a_variant_runs_the_project_with_its_environment(tmp_path, llama_checkpoint):
    run, calls = _fake_process({"project_bf16": [10.0], "project_bf16@thp": [8.0]})
    envs = []

    def spy(job, env, timeout):
        envs.append((job.get("name", job["contender"]), env))
        res = run(dict(job, contender=job.get("name", job["contender"])), env, timeout)
        return res

    data = bench_peers.main(
        [
            "--sizes",
            "tiny",
            "--model-dirs",
            f"tiny={llama_checkpoint}",
            "--batches",
            "1",
            "--contenders",
            "project_bf16",
            "--rounds",
            "2",
            "--variant",
            "thp=THP_MEM_ALLOC_ENABLE=1,OMP_PROC_BIND=true",
            "--out",
            str(tmp_path / "p.json"),
            "--work-dir",
            str(tmp_path / "w"),
        ],  # fmt: skip
        runner=spy,
        probe=lambda args: {"error": "no probe"},
    )
    by = dict(envs[1:3])  # after the one preparation, round 0
    assert by["project_bf16@thp"]["THP_MEM_ALLOC_ENABLE"] == "1"
    assert by["project_bf16@thp"]["OMP_PROC_BIND"] == "true"
    assert "THP_MEM_ALLOC_ENABLE" not in by["project_bf16"]
    r = {x["ratio"]: x["speedup"] for x in data["ratios"]}
    assert r["project_bf16@thp vs project_bf16"] == pytest.approx(10 / 8)


def test_llamacpp_extra_buffers_can_be_turned_off(tmp_path, llama_checkpoint, monkeypatch):
    """``--llamacpp-no-extra-bufts`` reaches every job (the worker then loads llama.cpp's model
    with ``use_extra_bufts`` off) and the run's settings; by default the jobs keep them on."""
    monkeypatch.setattr(bench_peers, "missing_packages", lambda c: [])
    (tmp_path / "q8_0").write_bytes(b"GGUF")  # the file a real run would write
    monkeypatch.setattr(bench_peers, "ensure_gguf", lambda folder, kind, work: tmp_path / kind)
    run, calls = _fake_process({"project_bf16": [10.0], "llamacpp_q8_0": [8.0]})
    for flag in ([], ["--llamacpp-no-extra-bufts"]):
        jobs = []
        data = bench_peers.main(
            ["--sizes", "tiny", "--model-dirs", f"tiny={llama_checkpoint}", "--batches", "1"]
            + ["--contenders", "project_bf16", "llamacpp_q8_0", "--rounds", "1"]
            + ["--out", str(tmp_path / f"p{len(flag)}.json"), "--work-dir", str(tmp_path / "w")]
            + flag,
            runner=lambda job, env, timeout: jobs.append(job) or run(job, env, timeout),
            probe=lambda args: {"error": "no probe"},
        )
        assert {j["llamacpp_extra_bufts"] for j in jobs} == {not flag}
        assert data["settings"]["llamacpp_no_extra_bufts"] is bool(flag)


def test_markdown_survives_a_round_that_timed_below_zero(tmp_path, llama_checkpoint):
    """Under load t(short) can exceed t(long): the row says so instead of failing the report."""
    run, calls = _fake_process({"project_bf16": [-1.0, 2.0]})
    data = bench_peers.main(
        [
            "--sizes",
            "tiny",
            "--model-dirs",
            f"tiny={llama_checkpoint}",
            "--batches",
            "1",
            "--contenders",
            "project_bf16",
            "--rounds",
            "2",
            "--out",
            str(tmp_path / "p.json"),
            "--work-dir",
            str(tmp_path / "w"),
        ],  # fmt: skip
        runner=run,
        probe=lambda args: {"error": "no probe"},
    )
    assert data["summary"]["tiny/project_bf16"]["batches"]["1"]["stats"]["spread"] is None
    assert "| tiny | project_bf16 | 1 | 0.50 | -1.00-2.00 | - | 2 |" in data["markdown"]


def test_project_int8_head_variant_quantizes_the_lm_head_too():
    """``--variant head=PIECEWISE_PEERS_INT8_HEAD=1``: the int8 contender quantizes every
    linear, the LM head included (as the q8_0 GGUF does); without it the head stays bf16."""
    from framework.core.quantization import QuantizationConfig

    plain = QuantizationConfig.parse(peers.project_int8_quantization({}))
    head = QuantizationConfig.parse(peers.project_int8_quantization({peers.INT8_HEAD_ENV: "1"}))
    layer = "model.layers.0.self_attn.qkv_proj"
    assert plain.spec_for(layer) == head.spec_for(layer) is not None
    assert plain.spec_for("lm_head") is None and head.spec_for("lm_head") == head.spec_for(layer)
    assert head.spec_for("model.embed_tokens") is None


def test_project_compile_sizes_variant():
    assert peers.project_compile_sizes({}) is None
    assert peers.project_compile_sizes({peers.COMPILE_SIZES_ENV: "1"}) == [1]
    assert peers.project_compile_sizes({peers.COMPILE_SIZES_ENV: "1, 8"}) == [1, 8]


def test_the_int8_head_variant_is_judged_against_q8_0_by_the_same_targets():
    """q8_0 quantizes ``output.weight``: ``project_int8@head`` (the same tensors quantized)
    gets the int8 targets' numbers beside the default int8 run, and its own ratio row."""
    from experiments.bench import targets

    def stats(contender, median):
        return {"contender": contender, "batches": {"1": {"stats": {"median": median, "n": 3}}}}

    summary = {
        f"tiny/{c}": stats(c, m)
        for c, m in (("llamacpp_q8_0", 3.0), ("project_int8", 6.0), ("project_int8@head", 2.5))
    }
    t = {x["target"]: x for x in targets.peer_targets(summary, {}, {})}
    plain = t["tiny, b1: project int8 vs llama.cpp q8_0"]
    head = t["tiny, b1: project int8 with an int8 LM head vs llama.cpp q8_0"]
    assert (plain["got"], plain["met"]) == (pytest.approx(0.5), False)
    assert (head["got"], head["met"]) == (pytest.approx(1.2), True)
    assert plain["want"] == head["want"] == ">= 1.1x"
    rows = {r["ratio"]: r["speedup"] for r in bench_peers.ratios(summary, ["tiny"], [1])}
    assert rows["project int8 (LM head int8, as q8_0) vs llama.cpp q8_0"] == pytest.approx(1.2)


def test_the_peak_rss_target_names_the_batch_it_was_read_after():
    """The 1.1B peak-RSS target reads ``VmHWM`` after the run's first batch: a b8-only run is
    labelled b8, not b1; a run without that reading falls back to the end-of-run figure."""
    from experiments.bench import targets

    models = {"1.1b": {"checkpoint_bytes": 2_200_000_000}}

    def row(batches, first):
        r = {"batches": {str(b): {"stats": None} for b in batches}}
        r["rss_peak_bytes"] = {"median": 2.9e9}
        r["rss_peak_first_batch_bytes"] = {"median": 2.5e9} if first else None
        return r

    def rss_targets(batches, first):
        summary = {"1.1b/project_bf16": row(batches, first)}
        return [x for x in targets.peer_targets(summary, {}, models) if "RSS" in x["target"]]

    (b8,) = rss_targets([8], True)
    assert "(GB, b8;" in b8["target"] and b8["got"] == pytest.approx(2.5) and b8["met"]
    (b1,) = rss_targets([8, 1], True)
    assert "(GB, b1;" in b1["target"]
    (end,) = rss_targets([1], False)
    assert "(GB, end of run;" in end["target"]
    assert end["got"] == pytest.approx(2.9) and not end["met"]
