"""Timing rounds, interleaved across the configurations of a sweep.

Why round-robin in one process (and not alternating processes): a sweep launched by Hydra's
basic launcher already runs every job in one process, one after the other. Each job builds
its LLM (the cold compile is measured then), generates once (outputs, trace, agreement) and
parks itself here instead of timing; when the last job is done, Hydra calls
:class:`InterleavedRounds` (``hydra.callbacks`` in conf/config.yaml), which times the workload
``rounds`` times for every parked configuration, round-robin (round r runs configuration
``(r + i) % N`` i-th, so no configuration always goes first), then writes every job's
results.json. A round of all configurations takes seconds, so drift of the machine (another
process, thermal state, frequency) hits every configuration alike, and the rounds of two
configurations pair up (experiments.report.statistics). Alternating processes would pay an
interpreter start and an artifact load per sample (~10 s here) and measure each configuration in a
different process; the price of one process is memory: every configuration's LLM is alive
until the rounds end (``interleave=false`` times each job right after it is built).

Launchers that run jobs in other processes (joblib, submitit, ray) cannot interleave: each job
times its rounds back to back and results.json says ``"interleaved": false``.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from hydra.experimental.callback import Callback

from experiments.report.statistics import median_ci
from experiments.run.cells import plan_cells

logger = logging.getLogger("experiments.run.sweep")


@dataclass
class PendingJob:
    """One configuration waiting for its timing rounds."""

    llm: Any
    """The configuration's first build (the cold start)."""
    prompts: list[list[int]]
    max_new_tokens: int
    ignore_eos: bool
    result: dict[str, Any]
    finish: Callable[[dict[str, Any]], None]
    """Writes results.json (and logs to the tracker) once the result is complete."""
    outputs: list[list[int]] = field(default_factory=list)
    logits: list[Any] = field(default_factory=list)
    baseline: bool = False
    rebuild: Optional[Callable[[], Any]] = None
    """Builds the configuration again (from its artifact cache: a warm start).  With it, the
    timed instances are ``builds`` such rebuilds, made at the start of the rounds, and the
    cold build is not timed (see :func:`build_instances`)."""
    builds: int = 1
    instances: list[Any] = field(default_factory=list)
    """What the rounds time: round r runs ``instances[r % len(instances)]``."""
    samples: dict[str, list[float]] = field(default_factory=dict)
    decode_steps: list[float] = field(default_factory=list)
    prefill_steps: list[float] = field(default_factory=list)
    error: Optional[str] = None
    """Set when a rebuild or a round of this entry raised: it leaves the rounds (the others
    go on) and its results.json records the error with ``"status": "failed"``."""


class SweepJobsFailed(SystemExit):
    """Raised at the end of a multirun, after every job that built was timed and recorded,
    when some jobs failed (each one's error is in its own run.log and results.json).  A
    ``SystemExit`` (exit code 1, the message on stderr): Hydra turns an ``Exception`` raised by
    a callback into a warning, and a sweep that lost jobs must not exit 0."""


_PARKED: list[PendingJob] = []
_FAILED: list[str] = []
"""One line per job of this multirun that failed before it could be parked."""


def record_failed_job(line: str) -> None:
    """Remember a failed job of the running multirun (reported when the sweep ends)."""
    _FAILED.append(line)


def failure_record(exc: BaseException, when: str) -> dict[str, Any]:
    """What results.json says about a failure: ``status``, ``error`` (one line), ``failed_at``
    and the ``traceback``."""
    import traceback

    return {
        "status": "failed",
        "error": f"{type(exc).__name__}: {exc}",
        "failed_at": when,
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }


def _fail_entry(entry: PendingJob, when: str, exc: Exception) -> None:
    logger.exception("job %s failed during %s", entry.result.get("job_dir"), when)
    record = failure_record(exc, when)
    entry.error = record["error"]
    entry.result.update(record)


def park(entry: PendingJob) -> None:
    """Keep ``entry`` for the interleaved rounds at the end of the sweep."""
    _PARKED.append(entry)


def parked() -> list[PendingJob]:
    return list(_PARKED)


def build_instances(entries: list[PendingJob], rounds: int) -> None:
    """The instances the rounds time: ``builds`` rebuilds of every entry.

    Why not time the cold build: measured here (default tiny model, fp32, O2, one process,
    round-robin), an LLM whose pieces were just compiled ran its decode step 10-20% slower
    than one loaded from the same cache (the same lean code; cause not found), and the builds
    made first in a process ran slower than later ones; an A/A sweep timed on the cold builds
    then called the first job's configuration significantly slower in 2 of 3 quiet runs.

    Two builds of one configuration can differ by more than rounds vary, so builds are a
    random effect.  With ``builds >= rounds`` (the default, ``builds: ${rounds}``) every round
    times its own build: the rounds are independent replicates of *build and run*, and the
    paired t over rounds is exact.  Those builds are made lazily, right before their round
    (:func:`instance_for`), and released after it, so only one extra instance per entry is
    alive at a time.  With fewer builds than rounds they are made here, in interleaved order
    (build k of every entry, starting at entry k), and round r runs build ``r % builds``.

    Either way one throwaway build (of the last entry) is made and used first, so that no
    timed instance is the first rebuild of the process.  An entry without ``rebuild`` is
    timed on its one build."""
    n = len(entries)
    for e in entries:
        e.instances = [] if e.rebuild is not None else [e.llm]
    rebuildable = [e for e in entries if e.rebuild is not None]
    if rebuildable:
        warm = rebuildable[-1]
        throwaway = warm.rebuild()
        throwaway.generate(
            warm.prompts, max_new_tokens=warm.max_new_tokens, ignore_eos=warm.ignore_eos
        )
        del throwaway
    for k in range(max((e.builds for e in entries if e.builds < rounds), default=0)):
        for i in range(n):
            e = entries[(k + i) % n]
            if e.rebuild is not None and k < e.builds < rounds and e.error is None:
                try:
                    e.instances.append(e.rebuild())
                except Exception as exc:  # this configuration leaves the rounds, alone
                    _fail_entry(e, f"rebuild {k}", exc)
    for e in entries:
        if e.rebuild is not None:
            e.llm = None  # the cold build: outputs and trace are taken, memory back


def per_round_builds(entry: PendingJob, rounds: int) -> bool:
    """Whether every round of ``entry`` times a fresh build (see :func:`build_instances`)."""
    return entry.rebuild is not None and entry.builds >= rounds


def instance_for(entry: PendingJob, r: int, rounds: int) -> tuple[Any, int]:
    """The instance round ``r`` times and its build index: a fresh build (warmed by one
    untimed generation) when every round has its own, else the prebuilt ``r % builds``."""
    if per_round_builds(entry, rounds):
        llm = entry.rebuild()
        llm.generate(
            entry.prompts, max_new_tokens=entry.max_new_tokens, ignore_eos=entry.ignore_eos
        )
        return llm, r
    return entry.instances[r % len(entry.instances)], r % len(entry.instances)


def time_round(entry: PendingJob, r: int = 0, rounds: int = 0) -> None:
    """Generate the workload once on round ``r``'s instance (:func:`instance_for`) and
    append this round's samples (ms, tokens/s, which build)."""
    llm, index = instance_for(entry, r, rounds)
    for times in llm.runner.step_times.values():
        times.clear()
    t0 = time.perf_counter()
    outputs = llm.generate(
        entry.prompts, max_new_tokens=entry.max_new_tokens, ignore_eos=entry.ignore_eos
    )
    elapsed = time.perf_counter() - t0
    st = llm.runner.step_times
    # With speculative decoding a decode-phase step is a verify step (several tokens each).
    decode = [t * 1e3 for t in st["decode"] + st.get("verify", [])]
    prefill = [t * 1e3 for t in st["prefill"] + st["mixed"]]
    entry.decode_steps += decode
    entry.prefill_steps += prefill
    sample = {
        "decode_median_ms": statistics.median(decode) if decode else None,
        "prefill_median_ms": statistics.median(prefill) if prefill else None,
        "tokens_per_s": sum(len(o) for o in outputs) / elapsed if elapsed > 0 else None,
        "wall_s": elapsed,
        "build": index,
    }
    for key, value in sample.items():
        entry.samples.setdefault(key, []).append(value)


def run_rounds(entries: list[PendingJob], rounds: int) -> None:
    """The timed instances (:func:`build_instances`), one untimed round of each prebuilt one
    (page faults, lazy allocations and allocator state settled alike; a per-round build gets
    its own), then ``rounds`` timed generations of every entry, round-robin with a rotating
    start."""
    build_instances(entries, rounds)
    n = len(entries)
    for e in entries:
        try:
            for llm in e.instances:
                llm.generate(e.prompts, max_new_tokens=e.max_new_tokens, ignore_eos=e.ignore_eos)
        except Exception as exc:
            _fail_entry(e, "the untimed round", exc)
    for r in range(rounds):
        for i in range(n):
            e = entries[(r + i) % n]
            if e.error is None:
                try:
                    time_round(e, r, rounds)
                except Exception as exc:
                    _fail_entry(e, f"timing round {r}", exc)
        logger.info("timing round %d/%d done (%d configurations)", r + 1, rounds, n)


def _latency(round_medians: list[Optional[float]], steps: list[float]) -> Optional[dict]:
    ci = median_ci([m for m in round_medians if m is not None])
    if ci is None:
        return None
    steps = sorted(steps)
    return {
        "median": ci[0],  # median over rounds of each round's median step
        "ci95": [ci[1], ci[2]],
        "p90": steps[min(len(steps) - 1, int(0.9 * len(steps)))],
        "n": len(steps),
        "rounds": len([m for m in round_medians if m is not None]),
    }


def complete(entry: PendingJob, interleaved: bool) -> dict[str, Any]:
    """Fill the timing part of the entry's result from its rounds."""
    r = entry.result
    s = entry.samples
    r["rounds"] = {
        "interleaved": interleaved,
        "n": len(s.get("wall_s", [])),
        "builds": len(set(s.get("build", []))) or len(entry.instances),
        "samples": s,
    }
    r["latency_ms"] = {
        "prefill": _latency(s.get("prefill_median_ms", []), entry.prefill_steps),
        "decode": _latency(s.get("decode_median_ms", []), entry.decode_steps),
    }
    tps = median_ci([x for x in s.get("tokens_per_s", []) if x is not None])
    r["tokens_per_s"] = None if tps is None else tps[0]
    r["tokens_per_s_ci95"] = None if tps is None else [tps[1], tps[2]]
    return r


def agree_with_baseline(entries: list[PendingJob]) -> None:
    """``agreement`` of every entry against its cell's baseline configuration
    (experiments/run/cells.py: the baseline that shares its values of the other swept keys)."""
    plan = plan_cells(
        [_override_map(e.result.get("overrides") or []) for e in entries],
        [e.baseline for e in entries],
        [str(e.result.get("job_dir")) for e in entries],
    )
    for e, b in zip(entries, plan.baseline_of):
        base = (
            entries[b]
            if b is not None and any(x.baseline for x in entries) and entries[b].error is None
            else None
        )
        if base is None:
            e.result["agreement_baseline"] = None
            continue
        agree = agreement(e.outputs, base.outputs, e.logits, base.logits)
        agree["baseline_job"] = base.result.get("job_dir")
        e.result["agreement_baseline"] = agree


def agreement(
    outputs: list[list[int]],
    reference: list[list[int]],
    logits: list[torch.Tensor],
    ref_logits: list[torch.Tensor],
) -> dict[str, Any]:
    """Token agreement (tokens equal up to each sequence's first divergence, over the longer
    length), the max abs difference of the first generated token's logits, exact equality."""
    total = same = 0
    for out, ref in zip(outputs, reference):
        total += max(len(out), len(ref))
        for a, b in zip(out, ref):
            if a != b:
                break
            same += 1
    diff = max(
        (
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(logits, ref_logits)
            if a is not None and b is not None
        ),
        default=0.0,
    )
    return {
        "token_agreement": same / total if total else 1.0,
        "max_logit_diff": diff,
        "outputs_equal": outputs == reference,
    }


def finish_all(entries: list[PendingJob], rounds: int, interleaved: bool) -> None:
    run_rounds(entries, rounds)
    agree_with_baseline(entries)
    for e in entries:
        e.finish(complete(e, interleaved))
    failed = [e for e in entries if e.error is not None]
    if failed and not interleaved:  # one job timing itself: its failure is the job's
        raise RuntimeError(f"{failed[0].result.get('job_dir')}: {failed[0].error}")


def _override_map(overrides: list[str]) -> dict[str, str]:
    out = {}
    for o in overrides:
        key, _, value = str(o).partition("=")
        out[key.lstrip("+~")] = value
    return out


def sweep_overrides(config: Any) -> list[list[str]]:
    """The override list of every job the multirun ``config`` launches (what Hydra's basic
    sweeper expands: ``hydra.sweeper.params``, then the command line)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    args = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(args)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def check_baselines(config: Any) -> None:
    """Before a multirun builds anything: every cell has at most one baseline job
    (:class:`experiments.run.cells.BaselineConflict` names the two jobs otherwise)."""
    from hydra import compose

    jobs = sweep_overrides(config)
    if len(jobs) < 2:
        return
    flags = [bool(compose("config", overrides=list(job)).get("baseline")) for job in jobs]
    plan_cells(
        [_override_map(job) for job in jobs],
        flags,
        [f"#{i} ({' '.join(job)})" for i, job in enumerate(jobs)],
    )


class InterleavedRounds(Callback):
    """Hydra callback: before a multirun, check its baselines (one per cell); at its end,
    time every parked configuration."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        check_baselines(config)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        entries = parked()
        failed = list(_FAILED)
        try:
            if entries:
                rounds = int(entries[0].result["config"].get("rounds") or 1)
                logger.info(
                    "interleaved timing: %d round(s) of %d configuration(s)", rounds, len(entries)
                )
                finish_all(entries, rounds, interleaved=True)
        finally:
            _PARKED.clear()
            _FAILED.clear()
        failed += [f"{e.result.get('job_dir')}: {e.error}" for e in entries if e.error is not None]
        if failed:
            message = (
                f"{len(failed)} job(s) of the sweep failed (every other job was timed and "
                f"recorded; each failure is in its job's run.log and results.json):\n  "
                + "\n  ".join(failed)
            )
            logger.error("%s", message)
            raise SweepJobsFailed(message)
