"""The main Hydra job: build an LLM from the composed config, run a workload, report.

    python -m experiments.run                                  # tiny model, O2
    python -m experiments.run compile=O1 workload=bench
    python -m experiments.run -m experiment=ablate_levels      # a sweep (see conf/experiment)

Prints a short summary and writes ``results.json`` (schema: experiments/README.md) and the
step trace ``trace.jsonl`` into the Hydra run folder.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments.pass_cli import apply_short
from experiments.sweep import Entry, agreement, finish_all, park
from framework.core.config import CompilationConfig, register_hydra_configs
from passes.registry import canonical_order, level_passes

logger = logging.getLogger("experiments.run")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


SYNTHETIC_DIR = Path(__file__).resolve().parent.parent / "models" / "synthetic"


def resolve_model_path(model_cfg: DictConfig) -> str:
    if model_cfg.source == "hf":
        return str(model_cfg.path)
    if model_cfg.source == "synthetic":
        path = SYNTHETIC_DIR / str(model_cfg.name)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.name={model_cfg.name!r}: no checkpoint in {path}")
        return str(path)
    from models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(preset=model_cfg.preset))


def make_prompts(workload: DictConfig, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = int(workload.prompt_len_min), int(workload.prompt_len_max)
    if not 0 < lo <= hi:
        raise ValueError(f"workload.prompt_len_min/max: need 0 < min <= max, got {lo}, {hi}")
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))]
        for _ in range(int(workload.num_prompts))
    ]


def prompt_seed(cfg: DictConfig) -> int:
    """The prompts' seed: ``workload.seed`` (the top-level ``seed`` seeds the LLM: sampling
    and calibration), so an A/A sweep over ``seed`` under greedy decoding sees the same
    prompts."""
    seed = cfg.workload.get("seed")
    return int(cfg.seed if seed is None else seed)


def synthetic_task_of(model_path: str):
    """The synthetic task a trained checkpoint was made for (experiments.train_synthetic writes
    it into the folder's metrics.json), or None for any other model."""
    metrics = Path(model_path) / "metrics.json"
    if not metrics.is_file():
        return None
    try:
        name = json.loads(metrics.read_text()).get("task")
    except (OSError, ValueError, AttributeError):
        return None
    from experiments.synthetic_task import get_task, task_names

    return get_task(name) if name in task_names() else None


def job_prompts(
    cfg: DictConfig, model_path: str, vocab_size: int
) -> tuple[list[list[int]], int, bool, Optional[list[list[int]]]]:
    """(prompts, max_new_tokens, ignore_eos, answers). A synthetic-task checkpoint gets
    ``workload.num_prompts`` held-out prompts of its task (answers known, so exact match is
    measured); any other model the workload's random prompts (answers None)."""
    task = synthetic_task_of(model_path)
    if task is None:
        return (
            make_prompts(cfg.workload, vocab_size, prompt_seed(cfg)),
            int(cfg.workload.max_new_tokens),
            bool(cfg.workload.ignore_eos),
            None,
        )
    logger.info(
        "%s is a %r synthetic-task checkpoint: %d held-out prompts, exact match recorded",
        model_path,
        task.name,
        int(cfg.workload.num_prompts),
    )
    keys = task.held_out_keys(int(cfg.workload.num_prompts), prompt_seed(cfg))
    prompts, answers = task.split(task.sequences(keys))
    # The answer ends with EOS: the model must stop by itself for an exact match.
    return prompts, task.answer_len + 1, False, answers


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


def text_examples(
    llm, model_path: str, prompts: list[list[int]], outputs: list[list[int]]
) -> Optional[list[dict[str, str]]]:
    """With a tokenizer: a few prompts and answers as text (None without one).  A synthetic
    addition checkpoint answers ``123+456=`` in the usual notation (its own writes numbers
    least significant digit first)."""
    if llm.tokenizer is None:
        return None
    task = synthetic_task_of(model_path)
    if task is not None and task.name == "addition":
        from experiments.synthetic_tokenizer import from_model_notation, to_model_notation

        shown = ["123+456=", "999+1=", "500+500="]
        answers = llm.generate(
            [to_model_notation(p) for p in shown], max_new_tokens=task.answer_len + 1
        )
        return [{"prompt": p, "answer": from_model_notation(a)} for p, a in zip(shown, answers)]
    dec = llm.tokenizer.decode
    return [
        {"prompt": dec(p, skip_special_tokens=True), "answer": dec(o, skip_special_tokens=True)}
        for p, o in zip(prompts[:3], outputs)
    ]


@contextmanager
def compiler_caches_under(cache_dir: Optional[str]):
    """Point Inductor's and Triton's own on-disk caches (FX graphs, generated code, compiled
    kernels) into ``cache_dir`` while the job runs, and drop Inductor's in-memory caches of
    earlier jobs in this process (the basic launcher runs a whole sweep in one process, joblib
    reuses its workers), so a fresh ``cache_dir`` means a cold compile and not a hit in a cache
    an earlier job filled. ``None``: untouched."""
    if cache_dir is None:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache_dir).resolve() / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(Path(cache_dir).resolve() / "triton")
    from torch._inductor.utils import clear_inductor_caches

    clear_inductor_caches()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_compiler_warmed_up = False


def warm_up_compiler() -> Optional[float]:
    """Pay Inductor's one-time start-up of this process (imports, C++ toolchain probing; ~10 s
    on a small CPU, whatever the model) on a throw-away function and cache, so ``cold_s``
    measures the model's own trace + compile and is comparable between the first compiling
    job of an in-process sweep and the later ones (or a job alone in its process). Returns
    the seconds spent, None when this process already paid it."""
    global _compiler_warmed_up
    if _compiler_warmed_up:
        return None
    import tempfile

    from torch._inductor.utils import clear_inductor_caches

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, compiler_caches_under(tmp):
        fn = torch.compile(
            lambda x, w: torch.nn.functional.silu(x @ w) * x.sum(-1, True),
            dynamic=True,
            fullgraph=True,
        )
        fn(torch.randn(8, 16), torch.randn(16, 16))
        torch._dynamo.reset()
        clear_inductor_caches()  # nothing of the throw-away compile may serve the job
    _compiler_warmed_up = True
    return time.perf_counter() - t0


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


def summary(r: dict[str, Any]) -> str:
    lat = r["latency_ms"]

    def fmt(d):
        if not d:
            return "—"
        ci = d.get("ci95")
        interval = f" [95% {ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
        return f"{d['median']:.2f} ms{interval} (p90 {d['p90']:.2f})"

    def agrees(agree, what):
        if agree is None:
            return f"  generated tokens agree with {what}: n/a"
        if agree["outputs_equal"]:
            return f"  generated tokens agree with {what}: yes"
        rate = agree["token_agreement"]
        return f"  generated tokens agree with {what}: no (agreement {rate:.3f})"

    rounds = r.get("rounds") or {}
    tps = r["tokens_per_s"]
    lines = [
        f"experiment {r['experiment']}  overrides {' '.join(r['overrides']) or '(none)'}",
        f"  start (cold) {r['compile']['cold_s']:.2f} s"
        + (f", warm {r['compile']['warm_s']:.2f} s" if r["compile"]["warm_s"] else ""),
        f"  timed in {rounds.get('n', 0)} round(s)"
        + (" interleaved with the sweep's other configurations" * bool(rounds.get("interleaved"))),
        f"  prefill step {fmt(lat['prefill'])}; decode step {fmt(lat['decode'])}",
        f"  tokens/s {'—' if tps is None else format(tps, '.1f')}",
        agrees(r["agreement"], "eager (O0)"),
    ]
    comp = r["compile"]
    if comp.get("compiles") is not None or comp.get("loads") is not None:
        lines.append(
            f"  pieces: {comp.get('compiles') or 0} compiled, {comp.get('loads') or 0} loaded "
            f"from the cache (cache hits {comp.get('cache_hits')}, misses "
            f"{comp.get('cache_misses')})"
        )
    if r.get("passes"):
        counts = [
            f"{name} {'not reported' if p.get('matches_reported') is False else p.get('matches')}"
            f" ({p.get('status')})"
            for name, p in r["passes"].items()
        ]
        lines.append("  pass matches: " + ", ".join(counts))
    if r.get("agreement_baseline") is not None:
        lines.append(agrees(r["agreement_baseline"], "the sweep's baseline"))
    for name in r.get("unmatched_fusions") or []:
        lines.append(f"  warning: fusion {name} matched nothing in the whole model")
    for ex in r.get("text_examples") or []:
        lines.append(f"  {ex['prompt']!r} -> {ex['answer']!r}")
    if r.get("accuracy"):
        lines.append(
            f"  exact match {r['accuracy']['exact_match']:.3f} "
            f"({r['accuracy']['n']} held-out prompts)"
        )
    return "\n".join(lines)


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
