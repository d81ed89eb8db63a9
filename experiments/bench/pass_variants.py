"""Side-by-side decode latency of pass and quantization variants, one process, round-robin.

    python -m experiments.bench.pass_variants  # the README's table (default tiny model)
    python -m experiments.bench.pass_variants --preset test-llama --rounds 2

Every variant is an ``LLM`` built up front; each round runs one generation per variant in
turn, so all of them see the same background load; the table reports the median over rounds
of each generation's median decode-step time, and the ratio to the first variant.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "O2 (bf16)": {},
    "O2 - prepack_linear": {"pass_config": {"passes": ["-prepack_linear"]}},
    "O2 + fuse_add_rmsnorm": {"pass_config": {"passes": ["+fuse_add_rmsnorm"]}},
    "O2 + int8_per_token (with quant fusions)": {
        "quant": "int8_per_token",
        "pass_config": {"passes": ["+fuse_rmsnorm_quant", "+fuse_silu_mul_quant"]},
    },
    "O2 + int8_per_token": {"quant": "int8_per_token"},
    "O2 + int8_per_channel_weight_only": {"quant": "int8_per_channel_weight_only"},
    "O2 + fp8_per_token": {"quant": "fp8_per_token"},
}


def run(
    preset: str, dtype: str, rounds: int, new_tokens: int, prompt_len: int, cache_dir: str | None
) -> list[tuple[str, float]]:
    from framework import LLM, CompilationConfig
    from models.tiny import ensure_tiny_model

    path = str(ensure_tiny_model(preset=preset))
    llms = {}
    for name, spec in VARIANTS.items():
        spec = dict(spec)
        quant = spec.pop("quant", None)
        cc = CompilationConfig(level=2, progress_bar=False, **spec)
        llms[name] = LLM(
            path, dtype=dtype, quantization=quant, compilation_config=cc, cache_dir=cache_dir
        )
    prompt = [[(i * 37) % 251 for i in range(prompt_len)]]
    medians: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            for times in llm.runner.step_times.values():
                times.clear()
            llm.generate(prompt, max_new_tokens=new_tokens, ignore_eos=True)
            medians[name].append(statistics.median(llm.runner.step_times["decode"]) * 1e3)
    return [(name, statistics.median(v)) for name, v in medians.items()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=33)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--cache-dir", default=None)
    a = p.parse_args(argv)
    rows = run(a.preset, a.dtype, a.rounds, a.new_tokens, a.prompt_len, a.cache_dir)
    base = rows[0][1]
    print("| configuration | decode ms | vs first |\n|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
