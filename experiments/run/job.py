"""The main Hydra job: build an LLM from the composed config, run a workload, report.

    python -m experiments.run                                  # tiny model, O2
    python -m experiments.run compile=O1 workload=bench
    python -m experiments.run -m experiment=ablate_levels      # a sweep (see conf/experiment)

Prints a short summary and writes ``results.json`` (schema: experiments/README.md) and the
step trace ``trace.jsonl`` into the Hydra run folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Optional

import hydra
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from experiments.run.compiler_env import compiler_caches_under, warm_up_compiler
from experiments.run.job_inputs import (
    copy_fraction,
    job_prompts,
    resolve_model_path,
    text_examples,
)
from experiments.run.job_summary import summary
from experiments.run.sweep import (
    PendingJob,
    agreement,
    failure_record,
    finish_all,
    park,
    record_failed_job,
)
from framework.core.config import CompilationConfig
from framework.core.files import atomic_write_text
from framework.engine.observers import FirstTokenLogits
from framework.engine.run_config import CONF_DIR as _CONF_DIR
from framework.engine.run_config import (  # noqa: F401  (re-exported: the jobs' mapping)
    compilation_config,
    int_setting,
    llm_kwargs,
    register_compile_schema,
    toggle_passes,
)
from passes.registry import canonical_order

logger = logging.getLogger("experiments.run.job")
CONF_DIR = str(_CONF_DIR)


def check_job_settings(cfg: DictConfig) -> None:
    """Refuse, before anything is built, the settings that would make a job measure nothing
    or fail late: every int the job reads is an int (the error names the key) and
    ``workload.num_prompts`` is at least 1."""
    for key in ("max_num_seqs", "max_model_len", "seed", "rounds", "workload.num_prompts"):
        if int_setting(cfg, key) is None:
            raise ValueError(f"{key}: must be an int, got None")
    for key in ("max_num_batched_tokens", "engine.block_size", "engine.kv_cache_memory_bytes"):
        int_setting(cfg, key)
    num_prompts = int_setting(cfg, "workload.num_prompts")
    if num_prompts < 1:
        raise ValueError(
            f"workload.num_prompts: must be >= 1 (a job with no prompts measures nothing), "
            f"got {num_prompts}"
        )
    if int_setting(cfg, "rounds") < 1:
        raise ValueError(f"rounds: must be >= 1, got {cfg.rounds!r}")


def build_llm(cfg: DictConfig, model_path: str, cc: CompilationConfig):
    from framework.engine.llm import LLM

    return LLM(model_path, **llm_kwargs(speculation_off_at_k0(cfg), cc))


def _echo_engine(cfg: DictConfig, model_path: str, cc: CompilationConfig):
    """``echo(prompts, n)`` for a copy workload (experiments.run.job_inputs.copy_prompts): the
    greedy continuations by a plain engine of this job's configuration (built on first use,
    then dropped), so every k of a sweep over speculation gets the same prompts and the job's
    own engine's statistics count the workload alone."""

    def echo(prompts: list[list[int]], n: int) -> list[list[int]]:
        engine = build_llm(without_speculation(cfg), model_path, cc)
        try:
            return engine.generate(prompts, n, ignore_eos=True)
        finally:
            engine.close()

    return echo


def speculation_off_at_k0(cfg: DictConfig) -> DictConfig:
    """``speculative.num_speculative_tokens=0`` is speculation off: the k = 0 row of a sweep
    over k (conf/experiment/ablate_spec.yaml) is the plain engine of that method's cell."""
    spec = cfg.get("speculative")
    if spec is None or OmegaConf.select(cfg, "speculative.num_speculative_tokens") != 0:
        return cfg
    return without_speculation(cfg)


def without_speculation(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with speculative decoding off (``speculative=none``)."""
    if cfg.get("speculative") is None:
        return cfg
    out = cfg.copy()
    with open_dict(out):
        out.speculative = None
    return out


def run_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Build, generate, check and time one configuration (its rounds back to back)."""
    entry = prepare_job(cfg, out_dir, finish=lambda result: None)
    finish_all([entry], int(cfg.rounds), interleaved=False)
    return entry.result


def prepare_job(
    cfg: DictConfig, out_dir: Path, finish: Callable[[dict[str, Any]], None]
) -> PendingJob:
    """Everything of a job but its timing rounds: the LLM (cold start timed), one generation
    (outputs, trace, first-token logits), the warm start, agreement with O0."""
    with compiler_caches_under(cfg.cache_dir):
        return _prepare_job(cfg, out_dir, finish)


def _prepare_job(
    cfg: DictConfig, out_dir: Path, finish: Callable[[dict[str, Any]], None]
) -> PendingJob:
    check_job_settings(cfg)
    if cfg.num_threads:
        torch.set_num_threads(int(cfg.num_threads))
    n_builds = cfg.get("builds", 1)
    if isinstance(n_builds, bool) or not isinstance(n_builds, int) or n_builds < 1:
        raise ValueError(
            f"builds: must be an int >= 1 (builds of each configuration), got {n_builds!r}"
        )
    model_path = resolve_model_path(cfg.model)
    cc = compilation_config(cfg)
    process_init_s = None
    if cc.level != 0 and cc.compiler in (None, "inductor"):
        process_init_s = warm_up_compiler()
    t0 = time.perf_counter()
    llm = build_llm(cfg, model_path, cc)
    cold_s = time.perf_counter() - t0
    prompts, max_new_tokens, ignore_eos, answers = job_prompts(
        cfg, model_path, llm.model_config.vocab_size, echo=_echo_engine(cfg, model_path, cc)
    )
    # The first generation (untimed: the rounds time the workload) gives the outputs, the
    # first-token logits and the step trace.
    with FirstTokenLogits.attached(llm) as first:
        outputs = llm.generate(prompts, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    logits = first.take()
    stats = llm.stats
    trace = llm.runner.trace or []
    llm.runner.trace = None  # the rounds add no steps to the trace
    warm_s = None
    if cfg.measure_warm_start and llm.config.level > 0 and llm.config.use_cache:
        t2 = time.perf_counter()
        build_llm(cfg, model_path, cc)
        warm_s = time.perf_counter() - t2
    agree = None
    if cfg.check_agreement:
        if llm.config.level == 0 and not cfg.quantization:
            agree = {"token_agreement": 1.0, "max_logit_diff": 0.0, "outputs_equal": True}
        else:
            # The reference of correctness: eager, unquantized, no speculation.
            ref_cfg = without_speculation(OmegaConf.merge(cfg, {"quantization": None}))
            ref_llm = build_llm(ref_cfg, model_path, CompilationConfig(level=0))
            with FirstTokenLogits.attached(ref_llm) as ref_first:
                ref_out = ref_llm.generate(
                    prompts, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos
                )
            agree = agreement(outputs, ref_out, logits, ref_first.take())
            del ref_llm
    copy = None
    if (cfg.workload.get("kind") or "random") == "copy":
        copy = {"copy_fraction": copy_fraction(prompts, outputs)}
    accuracy = None
    if answers is not None:
        from experiments.synthetic.task import exact_match

        accuracy = {"exact_match": exact_match(outputs, answers), "n": len(answers)}
    padding = _padding(trace, llm.config.cudagraph_capture_sizes)
    _write_trace(out_dir / "trace.jsonl", trace, llm.config.max_num_tokens)
    # PassManager.stats(): {name: {"status", "total_matches" (per piece instance),
    # "unique_graph_matches", "total_time_s", "pieces", "instances"}}
    passes = {
        name: {
            "matches": rec.get("total_matches", 0),
            "matches_reported": rec.get("matches_reported", True),
            "unique_graph_matches": rec.get("unique_graph_matches"),
            "status": rec.get("status"),
            "time_s": rec.get("total_time_s", 0.0),
        }
        for name, rec in (stats.get("passes") or {}).items()
    }
    result = {
        "status": "ok",
        "experiment": cfg.experiment_name,
        "overrides": _overrides(),
        "baseline": bool(cfg.baseline),
        "job_dir": str(out_dir),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "resolved_compilation": llm.config.to_dict(),
        "versions": {
            "torch": torch.__version__,
            "piecewise": "0.1.0",
            "python": platform.python_version(),
        },
        "compile": {
            "cold_s": cold_s,
            "warm_s": warm_s,
            "process_init_s": process_init_s,
            "dynamo_s": stats.get("dynamo_time_s"),
            "pieces": stats.get("compile_num_pieces"),
            "unique_artifacts": stats.get("compile_unique_graphs"),
            "compiles": stats.get("compile_compiles"),
            "loads": stats.get("compile_loads"),
            "cache_hits": stats.get("cache_hits"),
            "cache_misses": stats.get("cache_misses"),
            # where the artifacts live, and whether that is the per-user default root that
            # every run and clone without cache_dir shares (so a "first" run may load)
            "cache_dir": stats.get("cache_dir"),
            "cache_shared": cfg.cache_dir is None and llm.config.use_cache,
        },
        "latency_ms": {"prefill": None, "decode": None},  # filled by the timing rounds
        "tokens_per_s": None,
        "passes": passes,
        "unmatched_fusions": stats.get("unmatched_fusions") or [],
        "agreement": agree,  # against O0, unquantized (the reference of correctness)
        "agreement_baseline": None,  # against the sweep's baseline (filled after the rounds)
        "outputs": outputs,
        "accuracy": accuracy,
        # workload.kind=copy: how much of the outputs an n-gram lookup would have drafted
        "workload_copy": copy,
        "padding_waste": padding,
        "text_examples": text_examples(llm, model_path, prompts, outputs),
        "capture_sizes": llm.config.cudagraph_capture_sizes,
        # equal digests: the same compiled code (a toggle that changed nothing); the report
        # keeps such a job out of ★ and says its delta measures noise
        "code_digest": _code_digest(llm),
        # per range: the pieces' code, and which ranges the decode / prefill steps ran (a
        # toggle that changed no decode-range code cannot be credited with a decode effect)
        "code_digests": _range_digests(llm),
        "ranges_used": _ranges_used(llm, trace),
        "stats": {k: v for k, v in stats.items() if k != "passes"},
    }
    return PendingJob(
        llm=llm,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        ignore_eos=ignore_eos,
        result=result,
        finish=finish,
        outputs=outputs,
        logits=logits,
        baseline=bool(cfg.baseline),
        rebuild=lambda: build_llm(cfg, model_path, cc),
        builds=n_builds,
    )


def _write_failure(cfg: DictConfig, out_dir: Path, exc: BaseException) -> None:
    record = {
        **failure_record(exc, "build"),
        "experiment": cfg.get("experiment_name"),
        "overrides": _overrides(),
        "baseline": bool(cfg.get("baseline")),
        "job_dir": str(out_dir),
        "config": OmegaConf.to_container(cfg, resolve=False),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "results.json", json.dumps(record, indent=1, default=str))


def _padding(trace: list[dict], sizes: list[int]) -> Optional[float]:
    if not trace or not sizes:
        return None
    from experiments.tools.size_chooser import waste_fraction

    hist: dict[int, int] = {}
    for step in trace:
        hist[step["num_tokens"]] = hist.get(step["num_tokens"], 0) + 1
    return waste_fraction(sizes, hist, cover_max=False)


def _write_trace(path: Path, trace: list[dict], max_num_tokens: int) -> None:
    from experiments.run.trace import write_trace

    if trace:
        write_trace(path, trace, max_num_tokens)


def _overrides() -> list[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def interleaves(cfg: DictConfig, hydra_cfg: Any) -> bool:
    """Whether this job parks for the sweep's interleaved rounds: a multirun whose jobs share
    this process (Hydra's basic launcher), with ``interleave`` on."""
    from hydra.types import RunMode

    launcher = hydra_cfg.launcher.get("_target_") if hydra_cfg.get("launcher") else None
    return (
        bool(cfg.get("interleave", True))
        and hydra_cfg.mode == RunMode.MULTIRUN
        and launcher == BASIC_LAUNCHER
    )


def main_entry(cfg: DictConfig) -> Optional[float]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from experiments.run.tracking import log_mlflow, require_tracking

    require_tracking(cfg.tracking)  # a missing mlflow fails now, not after the compile
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    store_root = Path(hydra_cfg.sweep.dir) if multirun else out_dir

    def finish(result: dict[str, Any]) -> None:
        atomic_write_text(out_dir / "results.json", json.dumps(result, indent=1, default=str))
        print(summary(result))
        if cfg.tracking == "mlflow":
            # One store per sweep (its folder) so every job of a multirun shows in one MLflow UI.
            log_mlflow(result, out_dir, tracking_uri=cfg.get("tracking_uri"), store_root=store_root)

    try:
        entry = prepare_job(cfg, out_dir, finish)
    except Exception as e:
        # Recorded where the report looks (this job's run.log and results.json); in a
        # multirun whose jobs share this process the sweep goes on, the jobs that built
        # are still timed, and the sweep ends with an error listing the failed jobs.
        logger.exception("job %s failed", out_dir)
        _write_failure(cfg, out_dir, e)
        if interleaves(cfg, hydra_cfg):
            record_failed_job(f"{out_dir}: {type(e).__name__}: {e}")
            return None
        raise
    if interleaves(cfg, hydra_cfg):
        # Timed with the sweep's other configurations when the last job is done
        # (experiments.run.sweep.InterleavedRounds); results.json says so until then.
        pending = dict(entry.result, rounds={"pending": True})
        atomic_write_text(out_dir / "results.json", json.dumps(pending, indent=1, default=str))
        park(entry)
        return None
    finish_all([entry], int(cfg.rounds), interleaved=False)
    decode = entry.result["latency_ms"]["decode"]
    return decode["median"] if decode else None


def _code_digest(llm: Any) -> Optional[str]:
    """What the model runs, as one digest: the compiled pieces' code
    (``PiecewiseBackend.code_digest``) and what runs outside them -- every module's linear
    method (the LM head's packed path depends on ``prepack_linear`` without changing any
    piece). None when a piece's code is not known as text."""
    backend = getattr(getattr(llm, "compiled", None), "backend", None)
    pieces = backend.code_digest() if callable(getattr(backend, "code_digest", None)) else None
    if pieces is None:
        return None
    text = "\n".join([pieces, _eager_digest(llm)])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _eager_digest(llm: Any) -> str:
    """What runs outside the compiled pieces: every module's linear method (the LM head's
    prepacked path depends on ``prepack_linear`` without changing any piece)."""
    return "\n".join(
        sorted(
            f"{name}:{m.linear_method!r}"
            for name, m in llm.model.named_modules()
            if getattr(m, "linear_method", None) is not None
        )
    )


def _range_digests(llm: Any) -> Optional[dict[str, str]]:
    """Per compile range, the pieces' code digest with what runs outside the pieces (the
    ``eager`` part of :func:`_code_digest`) folded in; None when unknown."""
    backend = getattr(getattr(llm, "compiled", None), "backend", None)
    per_range = backend.code_digests() if backend is not None else None
    if not per_range:
        return None
    eager = _eager_digest(llm)
    return {
        rng: hashlib.sha256(f"{d}|{eager}".encode()).hexdigest()[:24]
        for rng, d in per_range.items()
    }


def _ranges_used(llm: Any, trace: list[dict]) -> Optional[dict[str, list[str]]]:
    """Which compile ranges the decode and the prefill (incl. mixed) steps of the traced
    generation dispatched to."""
    backend = getattr(getattr(llm, "compiled", None), "backend", None)
    if backend is None or not trace:
        return None
    used: dict[str, set[str]] = {"decode": set(), "prefill": set()}
    for step in trace:
        kind = "decode" if not step.get("num_prefill_tokens") else "prefill"
        rng = backend.range_for(int(step.get("num_padded_tokens") or step["num_tokens"]))
        if rng is not None:
            used[kind].add(rng)
    return {kind: sorted(v) for kind, v in used.items()}


def register_resolvers() -> None:
    """``${eq:a,b}`` -> ``a == b``: experiment files mark their baseline job with it, e.g.
    ``baseline: ${eq:${compile.level},0}`` (containers compare as plain lists/dicts).
    ``${pass_toggles:}``: see :func:`pass_toggle_sweep`.  ``${synthetic_model:name}``: see
    :func:`synthetic_model_path`."""

    def eq(a: Any, b: Any) -> bool:
        plain = [
            OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for v in (a, b)
        ]
        return plain[0] == plain[1]

    OmegaConf.register_new_resolver("eq", eq, replace=True)
    # ${synthetic_model:addition-draft} -> the folder models/synthetic/addition-draft (a
    # draft model's path for speculative.model, wherever the job is launched from).
    OmegaConf.register_new_resolver("synthetic_model", synthetic_model_path, replace=True)
    # ${pass_toggles:} -> "[],[noop_elimination],...": the ablate_passes sweep, one job per
    # registered pass (passes.registry.canonical_order) plus the baseline job.
    OmegaConf.register_new_resolver("pass_toggles", pass_toggle_sweep, replace=True)


def synthetic_model_path(name: str) -> str:
    """The checkpoint folder ``models/synthetic/<name>`` (a ``ValueError`` naming it when
    missing)."""
    from experiments.run.job_inputs import resolve_model_path

    return resolve_model_path(OmegaConf.create({"source": "synthetic", "name": name}))


def pass_toggle_sweep() -> str:
    """Hydra sweep values flipping every registered pass once, after the baseline ``[]``."""
    return ",".join(["[]"] + [f"[{name}]" for name in canonical_order()])


register_compile_schema()
register_resolvers()
# The quantization schema is deliberately not registered (run_config.register_quantization_schema
# says why).

main = hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(main_entry)

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
