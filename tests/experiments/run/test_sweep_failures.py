"""A sweep keeps what succeeded: a job that fails is recorded (its error in its own run.log
and results.json, a "Failed jobs" section in the report), the interleaved rounds still time
every job that built, and settings that would measure nothing are refused naming the key."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra_job_harness import TINY, run_job_in_process

from experiments.run import sweep
from experiments.run.sweep import InterleavedRounds, PendingJob, SweepJobsFailed

ROOT = Path(__file__).resolve().parents[3]
FAST = [*TINY, "compile=O0", "rounds=1", "builds=1", "check_agreement=false"]


@pytest.mark.parametrize(
    "override,message",
    [
        ("max_num_seqs=abc", "max_num_seqs: must be an int, got 'abc'"),
        ("workload.num_prompts=-1", "workload.num_prompts: must be >= 1"),
        ("workload.num_prompts=0", "workload.num_prompts: must be >= 1"),
        ("engine.block_size=1.5", "engine.block_size: must be an int"),
    ],
)
def test_bad_settings_are_refused_naming_the_key_and_recorded(override, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        run_job_in_process([*FAST, override], tmp_path / "job")
    results = json.loads((tmp_path / "job" / "results.json").read_text())
    assert results["status"] == "failed" and message in results["error"]
    assert "Traceback" in results["traceback"]


class _FakeLLM:
    def __init__(self, fail_at=None):
        self.calls = 0
        self.fail_at = fail_at
        self.runner = type("R", (), {"step_times": {"decode": [], "prefill": [], "mixed": []}})()

    def generate(self, prompts, max_new_tokens, ignore_eos):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("out of memory in round")
        self.runner.step_times["decode"] += [0.001, 0.002]
        self.runner.step_times["prefill"] += [0.01]
        return [[1, 2]] * len(prompts)


def _entry(llm, job, finished):
    return PendingJob(
        llm=llm,
        prompts=[[1, 2, 3]],
        max_new_tokens=2,
        ignore_eos=True,
        result={"job_dir": job, "config": {"rounds": 3}},
        finish=finished.append,
        outputs=[[1, 2]],
    )


def test_a_job_failing_in_the_rounds_leaves_the_others_timed():
    finished = []
    good, bad = _FakeLLM(), _FakeLLM(fail_at=3)  # the untimed round, round 0, then it fails
    sweep.park(_entry(good, "job0", finished))
    sweep.park(_entry(bad, "job1", finished))
    sweep.record_failed_job("job2: ValueError: LLM.max_model_len: must be a positive int")
    with pytest.raises(SweepJobsFailed, match=r"2 job\(s\) of the sweep failed") as info:
        InterleavedRounds().on_multirun_end(config=None)
    assert "job1: RuntimeError: out of memory in round" in str(info.value)
    assert "job2: ValueError" in str(info.value)
    by_job = {r["job_dir"]: r for r in finished}
    assert by_job["job0"].get("status") is None and by_job["job0"]["rounds"]["n"] == 3
    assert by_job["job0"]["latency_ms"]["decode"]["rounds"] == 3
    assert by_job["job1"]["status"] == "failed" and by_job["job1"]["failed_at"] == "timing round 1"
    assert by_job["job1"]["rounds"]["n"] == 1  # what it measured before failing is kept
    assert sweep.parked() == []


@pytest.mark.slow
def test_multirun_with_a_failing_job_times_the_others_and_reports_it(tmp_path):
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            "-m",
            *FAST,
            "rounds=2",
            "measure_warm_start=false",
            "max_model_len=128,0,96",
            f"hydra.sweep.dir={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0, "a sweep with a failed job must not exit 0"
    assert "1 job(s) of the sweep failed" in proc.stderr + proc.stdout
    for num in (0, 2):
        r = json.loads((out / str(num) / "results.json").read_text())
        assert r["status"] == "ok" and r["rounds"]["n"] == 2
        assert r["latency_ms"]["decode"]["median"] > 0
    failed = json.loads((out / "1" / "results.json").read_text())
    assert failed["status"] == "failed" and "max_model_len" in failed["error"]
    assert "max_model_len" in (out / "1" / "run.log").read_text()
    subprocess.run(
        [sys.executable, "-m", "experiments.report", str(out), "--no-plots"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    report = (out / "report.md").read_text()
    assert "## Failed jobs" in report and "max_model_len=0" in report.split("## Failed jobs")[1]
