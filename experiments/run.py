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
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from framework.config import CompilationConfig, register_hydra_configs

logger = logging.getLogger("experiments.run")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def resolve_model_path(model_cfg: DictConfig) -> str:
    if model_cfg.source == "hf":
        return str(model_cfg.path)
    from models.tiny import ensure_tiny_model
    return str(ensure_tiny_model(preset=model_cfg.preset))


def make_prompts(workload: DictConfig, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = int(workload.prompt_len_min), int(workload.prompt_len_max)
    if not 0 < lo <= hi:
        raise ValueError(f"workload.prompt_len_min/max: need 0 < min <= max, got {lo}, {hi}")
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))]
            for _ in range(int(workload.num_prompts))]


def compilation_config(cfg: DictConfig) -> CompilationConfig:
    data = OmegaConf.to_container(cfg.compile, resolve=True, enum_to_str=True)
    if cfg.cache_dir is not None:
        data["cache_dir"] = str(cfg.cache_dir)
    return CompilationConfig.from_dict(data)


def build_llm(cfg: DictConfig, model_path: str, cc: CompilationConfig):
    from framework.llm import LLM
    quant = cfg.quantization
    if isinstance(quant, DictConfig):
        quant = OmegaConf.to_container(quant, resolve=True)
    return LLM(model_path, dtype=cfg.dtype, compilation_config=cc, quantization=quant,
               max_num_seqs=int(cfg.max_num_seqs), max_model_len=int(cfg.max_model_len),
               max_num_batched_tokens=cfg.max_num_batched_tokens, seed=int(cfg.seed))


def _percentiles(values_s: list[float]) -> Optional[dict[str, float]]:
    if not values_s:
        return None
    ms = sorted(v * 1e3 for v in values_s)
    return {"median": statistics.median(ms), "p90": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
            "n": len(ms)}


def agreement(outputs: list[list[int]], reference: list[list[int]],
              logits: list[torch.Tensor], ref_logits: list[torch.Tensor]) -> dict[str, Any]:
    total = same = 0
    for out, ref in zip(outputs, reference):
        total += max(len(out), len(ref))
        for a, b in zip(out, ref):
            if a != b:
                break
            same += 1
    diff = max(((a - b).abs().max().item() for a, b in zip(logits, ref_logits)), default=0.0)
    return {"token_agreement": same / total if total else 1.0, "max_logit_diff": diff,
            "outputs_equal": outputs == reference}


def run_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    if cfg.num_threads:
        torch.set_num_threads(int(cfg.num_threads))
    model_path = resolve_model_path(cfg.model)
    cc = compilation_config(cfg)
    t0 = time.perf_counter()
    llm = build_llm(cfg, model_path, cc)
    cold_s = time.perf_counter() - t0
    prompts = make_prompts(cfg.workload, llm.model_config.vocab_size, int(cfg.seed))
    t1 = time.perf_counter()
    outputs = llm.generate(prompts, max_new_tokens=int(cfg.workload.max_new_tokens),
                           ignore_eos=bool(cfg.workload.ignore_eos))
    gen_s = time.perf_counter() - t1
    stats = llm.stats
    new_tokens = sum(len(o) for o in outputs)
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
            ref_llm = build_llm(OmegaConf.merge(cfg, {"quantization": None}), model_path,
                                CompilationConfig(level=0))
            ref_out = ref_llm.generate(prompts, max_new_tokens=int(cfg.workload.max_new_tokens),
                                       ignore_eos=bool(cfg.workload.ignore_eos))
            agree = agreement(outputs, ref_out, llm.first_token_logits,
                              ref_llm.first_token_logits)
    trace = llm.runner.trace or []
    padding = _padding(trace, llm.config.cudagraph_capture_sizes)
    _write_trace(out_dir / "trace.jsonl", trace, llm.config.max_num_tokens)
    # PassManager.stats(): {name: {"total_matches", "total_time_s", "pieces": [...]}}
    passes = {name: {"matches": rec.get("total_matches", 0),
                     "time_s": rec.get("total_time_s", 0.0)}
              for name, rec in (stats.get("passes") or {}).items()}
    return {
        "experiment": cfg.experiment_name,
        "overrides": _overrides(),
        "baseline": bool(cfg.baseline),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "resolved_compilation": llm.config.to_dict(),
        "versions": {"torch": torch.__version__, "piecewise": "0.1.0",
                     "python": platform.python_version()},
        "compile": {"cold_s": cold_s, "warm_s": warm_s,
                    "dynamo_s": stats.get("dynamo_time_s"),
                    "pieces": stats.get("compile_num_pieces"),
                    "unique_artifacts": stats.get("compile_unique_graphs"),
                    "compiles": stats.get("compile_compiles"),
                    "loads": stats.get("compile_loads"),
                    "cache_hits": stats.get("cache_hits"),
                    "cache_misses": stats.get("cache_misses")},
        "latency_ms": {"prefill": _percentiles(llm.runner.step_times["prefill"]
                                               + llm.runner.step_times["mixed"]),
                       "decode": _percentiles(llm.runner.step_times["decode"])},
        "tokens_per_s": new_tokens / gen_s if gen_s > 0 else None,
        "passes": passes,
        "agreement": agree,
        "accuracy": None,
        "padding_waste": padding,
        "capture_sizes": llm.config.cudagraph_capture_sizes,
        "stats": {k: v for k, v in stats.items() if k != "passes"},
    }


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
        return "—" if not d else f"{d['median']:.2f} ms (p90 {d['p90']:.2f})"
    agree = r["agreement"]
    lines = [
        f"experiment {r['experiment']}  overrides {' '.join(r['overrides']) or '(none)'}",
        f"  start (cold) {r['compile']['cold_s']:.2f} s"
        + (f", warm {r['compile']['warm_s']:.2f} s" if r["compile"]["warm_s"] else ""),
        f"  prefill step {fmt(lat['prefill'])}; decode step {fmt(lat['decode'])}",
        f"  tokens/s {r['tokens_per_s']:.1f}",
        "  generated tokens agree with eager: "
        + ("n/a" if agree is None else "yes" if agree["outputs_equal"]
           else f"no (agreement {agree['token_agreement']:.3f})"),
    ]
    return "\n".join(lines)


def main_entry(cfg: DictConfig) -> Optional[float]:
    from hydra.core.hydra_config import HydraConfig
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    result = run_job(cfg, out_dir)
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=str))
    print(summary(result))
    if cfg.tracking == "mlflow":
        from experiments.tracking import log_mlflow
        log_mlflow(result, out_dir)
    decode = result["latency_ms"]["decode"]
    return decode["median"] if decode else None


def register_resolvers() -> None:
    """``${eq:a,b}`` -> ``a == b``: experiment files mark their baseline job with it, e.g.
    ``baseline: ${eq:${compile.level},0}`` (containers compare as plain lists/dicts)."""
    def eq(a: Any, b: Any) -> bool:
        plain = [OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                 for v in (a, b)]
        return plain[0] == plain[1]
    OmegaConf.register_new_resolver("eq", eq, replace=True)


register_hydra_configs()
register_resolvers()
try:
    from framework.quantization import register_hydra_configs as _register_quant
    _register_quant()
except ImportError:  # pragma: no cover
    pass

main = hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(main_entry)

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
