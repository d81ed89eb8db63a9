"""Peak resident memory of a 1.1B-parameter Llama-shape model, bf16 and int8, each in a fresh
process: what an engine holds beside its weights.

    python -m experiments.bench.memory [--configs bf16 int8] [--prompt-len 32] [--steps 16]
        [--layers 22] [--model-dir DIR] [--cache-dir DIR] [--threads 2]

The checkpoint (hidden 2048, 22 layers, 32/4 heads, intermediate 5632, vocab 32000: the
TinyLlama shape; seeded random weights saved as bf16 safetensors, 2.2 GB) is written once,
tensor by tensor, under the project's model cache (``$PIECEWISE_MODEL_CACHE`` or
``~/.cache/piecewise/models``).  Each configuration then runs in its own process: ``LLM`` at
O2 (``int8``: ``quantization=int8_per_token``), one prompt of ``--prompt-len`` tokens (a
prefill above the small-M kernel's 16 rows) and ``--steps`` greedy decode steps.  The child
reports ``VmHWM`` (peak RSS, ``/proc/self/status``; the same figure as
``getrusage(RUSAGE_SELF).ru_maxrss``) after loading, after the first generate and at the end,
and the engine's own accounting (``LLM.stats['memory_*']``).  The target is
``peak <= checkpoint bytes + 0.6 GB``.  Run one configuration at a time on a shared machine:
each holds the whole model.

The artifact cache (``--cache-dir``, default under the same root) persists between runs, so the
first run of a configuration compiles (cold) and later runs load (warm); the report says which.
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from framework.core.files import publish_dir, tmp_path

TARGET_EXTRA_BYTES = 600 * 10**6
"""Allowed peak RSS beyond the checkpoint's bytes."""

SHAPE = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
)
RECIPE = 1
"""Bump when the checkpoint recipe changes (a new folder name)."""

CONFIGS = {"bf16": None, "int8": "int8_per_token"}


def cache_root() -> Path:
    from models.tiny import default_cache_root

    return default_cache_root()


def _tensors(shape: dict[str, int]) -> list[tuple[str, list[int]]]:
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", [v, h])]
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.input_layernorm.weight", [h]),
            (f"{p}.self_attn.q_proj.weight", [h, h]),
            (f"{p}.self_attn.k_proj.weight", [kv, h]),
            (f"{p}.self_attn.v_proj.weight", [kv, h]),
            (f"{p}.self_attn.o_proj.weight", [h, h]),
            (f"{p}.post_attention_layernorm.weight", [h]),
            (f"{p}.mlp.gate_proj.weight", [i, h]),
            (f"{p}.mlp.up_proj.weight", [i, h]),
            (f"{p}.mlp.down_proj.weight", [h, i]),
        ]
    return out + [("model.norm.weight", [h]), ("lm_head.weight", [v, h])]


def ensure_checkpoint(
    layers: int = SHAPE["num_hidden_layers"], root: Optional[Path] = None
) -> Path:
    """The cached checkpoint folder, written on first use (seeded, streamed tensor by tensor:
    never more than one tensor in memory; written to a temp folder, renamed into place)."""
    shape = dict(SHAPE, num_hidden_layers=layers)
    folder = (root or cache_root()) / f"llama-{layers}l-2048h-bf16-r{RECIPE}"
    if (folder / "model.safetensors").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(folder.parent, folder.name)
    tmp.mkdir()
    specs = _tensors(shape)
    header: dict[str, Any] = {}
    offset = 0
    for name, dims in specs:
        nbytes = 2 * int(torch.Size(dims).numel())
        header[name] = {"dtype": "BF16", "shape": dims, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator().manual_seed(0)
    with open(tmp / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dims in specs:
            t = torch.randn(dims, generator=gen)
            t = (1.0 + 0.1 * t) if name.endswith("norm.weight") else 0.02 * t
            f.write(t.to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    publish_dir(tmp, folder)  # another process may have won the race: then its folder stays
    return folder


def _vm_hwm() -> int:
    from framework.engine.llm_stats import process_memory

    return process_memory().get("rss_peak_bytes", 0)


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this (fresh) process."""
    from framework import LLM, CompilationConfig

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    llm = LLM(
        args.model_dir,
        dtype="bfloat16",
        quantization=CONFIGS[args.child],
        max_num_seqs=1,
        max_model_len=args.prompt_len + args.steps + 16,
        compilation_config=CompilationConfig(level=2, cache_dir=args.cache_dir, progress_bar=False),
    )
    built_s = time.perf_counter() - t0
    after_load = _vm_hwm()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(32000, (args.prompt_len,), generator=gen).tolist()
    tokens = llm.generate([prompt], args.steps, ignore_eos=True)[0]
    stats = llm.stats
    return {
        "config": args.child,
        "build_s": built_s,
        "warm": stats.get("compile_loads", 0) > 0 and stats.get("compile_compiles", 0) == 0,
        "peak_after_load": after_load,
        "peak": _vm_hwm(),
        "ru_maxrss": _ru_maxrss(),
        "tokens": tokens,
        **{k: v for k, v in stats.items() if k.startswith("memory_")},
    }


def _ru_maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_config(config: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "experiments.bench.memory",
        "--child",
        config,
        "--model-dir",
        str(model_dir),
        "--cache-dir",
        args.cache_dir,
        "--prompt-len",
        str(args.prompt_len),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{config}: the child failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--model-dir", help="an existing checkpoint (default: the cached 1.1B one)")
    p.add_argument("--cache-dir", help="artifact cache (default: under the model cache root)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the rows (tokens included) to this file")
    p.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cache_dir is None:
        args.cache_dir = str(cache_root() / "bench_memory_artifacts")
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return []
    model_dir = Path(args.model_dir) if args.model_dir else ensure_checkpoint(args.layers)
    weights = (model_dir / "model.safetensors").stat().st_size
    rows = []
    print(f"# {model_dir}: checkpoint {weights / 1e9:.3f} GB; target peak <= weights + 0.6 GB")
    print(
        "| config | cache | peak RSS GB | after load GB | peak - weights GB | target | "
        "engine weights GB | packed GB | KV GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        r = run_config(config, model_dir, args)
        r["checkpoint_bytes"] = weights
        r["meets_target"] = r["peak"] <= weights + TARGET_EXTRA_BYTES
        rows.append(r)
        print(
            f"| {config} | {'warm' if r['warm'] else 'cold'} | {r['peak'] / 1e9:.3f} | "
            f"{r['peak_after_load'] / 1e9:.3f} | {(r['peak'] - weights) / 1e9:+.3f} | "
            f"{'met' if r['meets_target'] else 'MISSED'} | "
            f"{r['memory_weights_bytes'] / 1e9:.3f} | "
            f"{r['memory_packed_weight_bytes'] / 1e9:.3f} | "
            f"{r['memory_kv_cache_bytes'] / 1e9:.4f} |",
            flush=True,
        )
    for r in rows:
        print(f"# {r['config']} greedy tokens: {r['tokens']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
