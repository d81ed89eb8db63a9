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
from omegaconf import DictConfig, OmegaConf

from experiments.compiler_env import compiler_caches_under, warm_up_compiler
from experiments.job_inputs import job_prompts, resolve_model_path, text_examples
from experiments.job_summary import summary
from experiments.pass_cli import apply_short
from experiments.sweep import Entry, agreement, finish_all, park
from framework.core.config import CompilationConfig, register_hydra_configs
from passes.registry import canonical_order, level_passes

logger = logging.getLogger("experiments.run")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def compilation_config(cfg: DictConfig) -> CompilationConfig:
    data = OmegaConf.to_container(cfg.compile, resolve=True, enum_to_str=True)
    if cfg.cache_dir is not None:
        data["cache_dir"] = str(cfg.cache_dir)
    short = cfg.get("passes")
    if short is not None:
        short = OmegaConf.to_container(short) if OmegaConf.is_config(short) else short
        data["pass_config"] = apply_short(short, dict(data.get("pass_config") or {}))
    toggles = cfg.get("toggle_passes")
    if toggles:
        data["pass_config"] = toggle_passes(
            data.get("pass_config") or {},
            list(toggles),
            level=2 if data.get("level") is None else int(data["level"]),
            device_type=str(cfg.get("device") or "cpu"),
        )
    return CompilationConfig.from_dict(data)


def toggle_passes(pass_config: dict, names: list[str], level: int, device_type: str) -> dict:
    """``pass_config`` with each of ``names`` flipped against the level's default pass list on
    ``device_type`` (or the explicit ``passes`` list): a pass that would run goes to
    ``disable``, one that would not goes to ``enable``. ``toggle_passes=[x]`` is how
    conf/experiment/ablate_passes.yaml switches one pass on/off against O2 on any device,
    though O2's list differs between CPU and CUDA (``levels`` of ``@register_pass``)."""
    runs = pass_config.get("passes")
    runs = set(level_passes(level, device_type) if runs is None else runs)
    out = dict(pass_config)
    out["disable"] = list(out.get("disable") or []) + [n for n in names if n in runs]
    out["enable"] = list(out.get("enable") or []) + [n for n in names if n not in runs]
    return out


def build_llm(cfg: DictConfig, model_path: str, cc: CompilationConfig):
    from framework.engine.llm import LLM

    quant = cfg.quantization
    if isinstance(quant, DictConfig):
        quant = OmegaConf.to_container(quant, resolve=True)
    engine = cfg.get("engine") or {}
    kv_bytes = engine.get("kv_cache_memory_bytes")
    return LLM(
        model_path,
        dtype=cfg.dtype,
        compilation_config=cc,
        quantization=quant,
        max_num_seqs=int(cfg.max_num_seqs),
        max_model_len=int(cfg.max_model_len),
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        seed=int(cfg.seed),
        enable_prefix_caching=bool(engine.get("enable_prefix_caching", False)),
        block_size=int(engine.get("block_size", 16)),
        kv_cache_memory_bytes=None if kv_bytes is None else int(kv_bytes),
        tensor_parallel_size=int((cfg.get("parallel") or {}).get("tensor_parallel_size", 1)),
    )


def run_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Build, generate, check and time one configuration (its rounds back to back)."""
    entry = prepare_job(cfg, out_dir, finish=lambda result: None)
    finish_all([entry], int(cfg.rounds), interleaved=False)
    return entry.result


def prepare_job(cfg: DictConfig, out_dir: Path, finish: Callable[[dict[str, Any]], None]) -> Entry:
    """Everything of a job but its timing rounds: the LLM (cold start timed), one generation
    (outputs, trace, first-token logits), the warm start, agreement with O0."""
    with compiler_caches_under(cfg.cache_dir):
        return _prepare_job(cfg, out_dir, finish)


def _prepare_job(cfg: DictConfig, out_dir: Path, finish: Callable[[dict[str, Any]], None]) -> Entry:
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
    if cc.level != 0 and cc.backend in (None, "inductor"):
        process_init_s = warm_up_compiler()
    t0 = time.perf_counter()
    llm = build_llm(cfg, model_path, cc)
    cold_s = time.perf_counter() - t0
    prompts, max_new_tokens, ignore_eos, answers = job_prompts(
        cfg, model_path, llm.model_config.vocab_size
    )
    # The first generation (untimed: the rounds time the workload) gives the outputs, the
    # first-token logits and the step trace.
    outputs = llm.generate(prompts, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    logits = list(llm.first_token_logits)
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
            ref_llm = build_llm(
                OmegaConf.merge(cfg, {"quantization": None}), model_path, CompilationConfig(level=0)
            )
            ref_out = ref_llm.generate(
                prompts, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos
            )
            agree = agreement(outputs, ref_out, logits, ref_llm.first_token_logits)
            del ref_llm
    accuracy = None
    if answers is not None:
        from experiments.synthetic_task import exact_match

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
        },
        "latency_ms": {"prefill": None, "decode": None},  # filled by the timing rounds
        "tokens_per_s": None,
        "passes": passes,
        "unmatched_fusions": stats.get("unmatched_fusions") or [],
        "agreement": agree,  # against O0, unquantized (the reference of correctness)
        "agreement_baseline": None,  # against the sweep's baseline (filled after the rounds)
        "outputs": outputs,
        "accuracy": accuracy,
        "padding_waste": padding,
        "text_examples": text_examples(llm, model_path, prompts, outputs),
        "capture_sizes": llm.config.cudagraph_capture_sizes,
        # equal digests: the same compiled code (a toggle that changed nothing); the report
        # keeps such a job out of ★ and says its delta measures noise
        "code_digest": _code_digest(llm),
        "stats": {k: v for k, v in stats.items() if k != "passes"},
    }
    return Entry(
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


def _padding(trace: list[dict], sizes: list[int]) -> Optional[float]:
    if not trace or not sizes:
        return None
    from experiments.size_chooser import waste_fraction

    hist: dict[int, int] = {}
    for step in trace:
        hist[step["num_tokens"]] = hist.get(step["num_tokens"], 0) + 1
    return waste_fraction(sizes, hist, cover_max=False)


def _write_trace(path: Path, trace: list[dict], max_num_tokens: int) -> None:
    from experiments.trace import write_trace

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

    from experiments.tracking import log_mlflow, require_tracking

    require_tracking(cfg.tracking)  # a missing mlflow fails now, not after the compile
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    store_root = Path(hydra_cfg.sweep.dir) if multirun else out_dir

    def finish(result: dict[str, Any]) -> None:
        (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=str))
        print(summary(result))
        if cfg.tracking == "mlflow":
            # One store per sweep (its folder) so every job of a multirun shows in one MLflow UI.
            log_mlflow(result, out_dir, tracking_uri=cfg.get("tracking_uri"), store_root=store_root)

    entry = prepare_job(cfg, out_dir, finish)
    if interleaves(cfg, hydra_cfg):
        # Timed with the sweep's other configurations when the last job is done
        # (experiments.sweep.InterleavedRounds); results.json says so until then.
        pending = dict(entry.result, rounds={"pending": True})
        (out_dir / "results.json").write_text(json.dumps(pending, indent=1, default=str))
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
    eager = sorted(
        f"{name}:{m.linear_method!r}"
        for name, m in llm.model.named_modules()
        if getattr(m, "linear_method", None) is not None
    )
    text = "\n".join([pieces, *eager])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def register_resolvers() -> None:
    """``${eq:a,b}`` -> ``a == b``: experiment files mark their baseline job with it, e.g.
    ``baseline: ${eq:${compile.level},0}`` (containers compare as plain lists/dicts).
    ``${pass_toggles:}``: see :func:`pass_toggle_sweep`."""

    def eq(a: Any, b: Any) -> bool:
        plain = [
            OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for v in (a, b)
        ]
        return plain[0] == plain[1]

    OmegaConf.register_new_resolver("eq", eq, replace=True)
    # ${pass_toggles:} -> "[],[noop_elimination],...": the ablate_passes sweep, one job per
    # registered pass (passes.registry.canonical_order) plus the baseline job.
    OmegaConf.register_new_resolver("pass_toggles", pass_toggle_sweep, replace=True)


def pass_toggle_sweep() -> str:
    """Hydra sweep values flipping every registered pass once, after the baseline ``[]``."""
    return ",".join(["[]"] + [f"[{name}]" for name in canonical_order()])


register_hydra_configs()
register_resolvers()
# framework.core.quantization.register_hydra_configs() is deliberately not called: it stores a
# config *group* named "quantization", which makes Hydra treat the top-level `quantization`
# value of config.yaml as a group and reject `quantization=int8_per_token` ("Could not
# override 'quantization'. No match in the defaults list"). Values are checked by
# QuantizationConfig.parse when the LLM is built.

main = hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(main_entry)

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
