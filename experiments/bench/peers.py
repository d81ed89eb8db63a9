"""The project against the engines a CPU user would pick instead: llama.cpp and CTranslate2.

    python -m experiments.bench.peers  # the full run -> results/peers_cpu.json
    python -m experiments.bench.peers --sizes tiny --batches 1 --rounds 2   # a short look
    python -m experiments.bench.peers --contenders project_bf16 --sizes 1.1b --batches 1 \\
        --rounds 4 --out spread.json                        # the project's spread alone

Same weights for every contender: the default tiny model (``models.tiny``, transformers'
classes, 8 layers, hidden 512) and the 1.1B TinyLlama shape (``experiments.bench.memory``'s
checkpoint: hidden 2048, 22 layers, 32/4 heads, intermediate 5632, vocab 32000), seeded
random bf16 weights.  llama.cpp gets GGUF files written from them by
:mod:`experiments.bench.gguf_writer` (bf16 and q8_0, q/k permuted as llama.cpp's converter does),
CTranslate2 its own converter's output (``TransformersConverter``, int8).  The files are made
once under ``--work-dir`` (default ``~/.cache/piecewise/peers``).

Method (``experiments.bench.peer_worker`` runs one contender in one fresh process):

- the project's bf16 run first makes the reference: its greedy tokens (``--check-tokens`` =
  16 new tokens per prompt, batch by batch) and compiles the artifacts (its start then is a
  cold one, reported apart); the project int8 gets the same untimed preparation;
- ``--rounds`` rounds; in each every contender runs once, in its own process, in an order that
  rotates from round to round; a process measures every batch of ``--batches``;
- in a process, per batch: the token check first (an exact contender whose median sequence
  differs from the reference before step ``--min-identical`` (8) is reported, not timed; a later
  divergence, where random weights' near-tied logits meet rounding, is reported per sequence
  and timed; int8 / q8_0 agreement is reported with the first diverging step), then
  ``--reps`` alternating generations of 72 and 8 new tokens from the
  ``--prompt-len`` (64) token prompts; per step = (best t(72) - best t(8)) / 64: the per-token
  time at batch 1, the per-step time of the whole batch otherwise;
- greedy decoding, ``--threads`` (2) threads, no EOS stop;
- per contender: medians over the rounds, min, max and spread (max / min); ratios of medians;
  start time (library import + model load, in the fresh process), the time to the first two
  tokens (start + the first generation: a contender that maps its weights lazily reads them
  there), the share of its weight files the page cache held at start, peak RSS (``VmHWM``);
- ``--evict``: each timed process first drops its contender's weight files (the project: the
  artifact cache, processed weights included) from the page cache (``posix_fadvise``, no
  privileges): starts that read from disk, as after the host reclaimed idle memory;
- the machine's read bandwidth by the native probe (:mod:`experiments.bench.bandwidth`), in its own
  process; the floor of each size = the bytes a decode step must stream (every weight but
  the embedding table, at the contender's bytes per weight) / the best read bandwidth measured
  in the run (the probe's, or a contender's own streaming rate if that is higher);
- the targets (:func:`experiments.bench.targets.peer_targets`) with met / NOT met.

Restartable: every finished process is appended to ``--out`` at once; a rerun with the same
settings skips what is there (``--fresh`` starts over).  Each process also records the load
the machine was under while it ran (other processes' CPU share, hypervisor steal, load average).

Peers need the optional extra ``peers`` (``gguf``, ``ctranslate2``, ``llama-cpp-python``); a
missing package leaves its contenders out, said in the report.  ``llama-cpp-python`` builds
llama.cpp from source (minutes on 2 cores): see the README.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from experiments.bench import RESULTS_DIR
from experiments.bench import targets as bench_targets
from experiments.bench.machine import ISA_FLAGS, machine  # noqa: F401  (ISA_FLAGS: tests)
from experiments.bench.peer_summary import floors, markdown, ratios, summarize
from experiments.bench.peer_worker import KINDS, RESULT_MARK
from framework.core.files import publish_dir

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = RESULTS_DIR / "peers_cpu.json"
SIZES = ("tiny", "1.1b")
DEFAULT_CONTENDERS = ("project_bf16", "llamacpp_bf16", "project_int8", "llamacpp_q8_0", "ct2_int8")
NEEDS = {
    "llamacpp_bf16": ("llama_cpp", "gguf"),
    "llamacpp_q8_0": ("llama_cpp", "gguf"),
    "ct2_int8": ("ctranslate2",),
    "hf_eager": ("transformers",),
}
ENV_KEYS = (
    "OMP_NUM_THREADS",
    "OMP_PROC_BIND",
    "OMP_PLACES",
    "GOMP_CPU_AFFINITY",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "THP_MEM_ALLOC_ENABLE",
    "MALLOC_ARENA_MAX",
    "LD_PRELOAD",
)
"""Environment variables a worker records (process set-up that can change its speed)."""
SETTINGS = (
    "sizes",
    "batches",
    "prompt_len",
    "new_tokens",
    "reps",
    "threads",
    "check_tokens",
    "min_identical",
    "level",
    "model_dirs",
    "project_env",
    "variant",
    "llamacpp_no_extra_bufts",
    "evict",
)
"""What must match for a rerun to reuse an existing output file's runs."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- models
def model_dir(size: str, overrides: Optional[dict[str, str]] = None) -> Path:
    if overrides and size in overrides:
        return Path(overrides[size])
    if size == "tiny":
        from models.tiny import ensure_tiny_model

        return ensure_tiny_model(preset="default")
    if size == "1.1b":
        from experiments.bench.memory import ensure_checkpoint

        return ensure_checkpoint()
    raise ValueError(f"unknown size {size!r}; sizes are {SIZES}")


def tensor_numels(folder: Path) -> dict[str, tuple[int, int]]:
    """name -> (number of elements, dims) from the safetensors headers."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            out[name] = (numel, len(info["shape"]))
    return out


def streamed_bytes(folder: Path) -> dict[str, int]:
    """Bytes a decode step streams, per weight format: every weight but the embedding table
    (which a step reads one row of; with tied embeddings it is the LM head and counts)."""
    config = json.loads((folder / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    bf16 = q8 = 0
    for name, (numel, dims) in tensor_numels(folder).items():
        if name == "model.embed_tokens.weight" and not tied:
            continue
        bf16 += 2 * numel
        q8 += numel * 34 // 32 if dims == 2 else 4 * numel
    return {"bf16": bf16, "q8_0": q8}


def checkpoint_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def missing_packages(contender: str) -> list[str]:
    return [m for m in NEEDS.get(contender, ()) if not have(m)]


def ensure_gguf(folder: Path, kind: str, work: Path) -> Path:
    from experiments.bench.gguf_writer import write_gguf

    out = work / "gguf" / f"{folder.name}-{kind}.gguf"
    if not out.is_file() or out.stat().st_mtime < (folder / "config.json").stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        log(f"  writing {out.name}")
        write_gguf(folder, out, kind)
    return out


def write_placeholder_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` tokens (``<unk>``, ``<s>``, ``</s>``, ``tN``):
    CTranslate2's converter takes the vocabulary from a tokenizer; the benchmark feeds ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    names = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab_size)]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(str(folder))


def convert_ct2(folder: Path, out: Path) -> None:
    """CTranslate2's own converter on the checkpoint (in this process: run as a child)."""
    import ctranslate2

    config = json.loads((folder / "config.json").read_text())
    with tempfile.TemporaryDirectory(prefix="ct2-src-") as src:
        srcp = Path(src)
        for f in folder.iterdir():
            if f.suffix in (".json", ".safetensors") and not f.name.startswith("tokenizer"):
                (srcp / f.name).symlink_to(f.resolve())
        write_placeholder_tokenizer(srcp, config["vocab_size"])
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        ctranslate2.converters.TransformersConverter(str(srcp), low_cpu_mem_usage=True).convert(
            str(tmp), quantization="int8", force=True
        )
        publish_dir(tmp, out, replace=True)


def ensure_ct2(folder: Path, work: Path) -> Path:
    out = work / "ct2" / f"{folder.name}-int8"
    if not (out / "model.bin").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        log(f"  converting {folder.name} for CTranslate2")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "experiments.bench.peers",
                "--convert-ct2",
                str(folder),
                str(out),
            ],
            cwd=ROOT,
            env=_child_env({}),
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"CTranslate2 conversion failed:\n{proc.stderr[-3000:]}")
    return out


# ----------------------------------------------------------------------------- processes
def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return env


def run_process(job: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One contender in one fresh process; its result (raises with the stderr tail)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dict(job, process_start=time.time()), f)
        path = f.name
    try:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.bench.peer_worker", path],
            cwd=ROOT,
            env=_child_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        os.unlink(path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{job['contender']} ({job['size']}) failed with exit code {proc.returncode}:\n"
            f"{proc.stderr[-3000:]}"
        )
    res = json.loads(lines[-1][len(RESULT_MARK) :])
    res["process_wall_s"] = time.perf_counter() - t0
    return res


def probe_process(args: argparse.Namespace) -> dict[str, Any]:
    """The native read-bandwidth probe in its own process (nothing else of ours resident)."""
    code = (
        "import json, sys, torch; torch.set_num_threads(int(sys.argv[1])); "
        "from experiments.bench.bandwidth import probe_read_bandwidth; "
        "print('PROBE ' + json.dumps(probe_read_bandwidth(int(sys.argv[2]))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(args.threads), str(args.probe_megabytes)],
        cwd=ROOT,
        env=_child_env({}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr[-2000:]}
    return json.loads(lines[-1][6:])


# ----------------------------------------------------------------------------- results file
def load_results(path: Path, settings: dict[str, Any], fresh: bool) -> dict[str, Any]:
    if path.is_file() and not fresh:
        data = json.loads(path.read_text())
        if data.get("settings") == settings:
            return data
        log(f"{path}: written with other settings; starting over (old file kept as .old)")
        shutil.copyfile(path, path.with_suffix(path.suffix + ".old"))
    return {
        "settings": settings,
        "machine": machine(),
        "runs": [],
        "prepare": [],
        "probes": [],
        "skipped": {},
    }


def save(path: Path, data: dict[str, Any]) -> None:
    from framework.core.files import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1))


def done(data: dict[str, Any], size: str, contender: str, round_: int) -> bool:
    return any(
        (r["size"], r["contender"], r["round"]) == (size, contender, round_) for r in data["runs"]
    )


# ----------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--contenders", nargs="+", default=list(DEFAULT_CONTENDERS), choices=KINDS)
    p.add_argument("--rounds", type=int, default=4, help="fresh processes per contender and size")
    p.add_argument("--reps", type=int, default=3, help="long/short generation pairs per batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--level", type=int, default=2, help="the project's optimization level")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", nargs=2, type=int, default=[8, 72], metavar=("SHORT", "LONG"))
    p.add_argument("--check-tokens", type=int, default=16)
    p.add_argument(
        "--min-identical",
        type=int,
        default=8,
        help="a bf16 peer is timed when its median sequence equals the reference this long",
    )
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--work-dir", help="models, GGUF, artifacts (default ~/.cache/piecewise/peers)")
    p.add_argument("--fresh", action="store_true", help="ignore the runs already in --out")
    p.add_argument("--probe-megabytes", type=int, default=1024)
    p.add_argument(
        "--project-env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the project's processes (e.g. THP_MEM_ALLOC_ENABLE=1)",
    )
    p.add_argument(
        "--model-dirs",
        nargs="*",
        default=[],
        metavar="SIZE=DIR",
        help="a Llama checkpoint folder for a size instead of the generated one",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=KEY=VALUE[,KEY=VALUE]",
        help="also run the project's contenders with this environment, as '<contender>@NAME' "
        "(e.g. thp=THP_MEM_ALLOC_ENABLE=1): A/B of process set-up, alternated like the rest",
    )
    p.add_argument(
        "--llamacpp-no-extra-bufts",
        action="store_true",
        help="load llama.cpp's models with use_extra_bufts off (no repacked CPU weight buffers, "
        "as llama.cpp's --no-repack): llama-cpp-python 0.3.36's q8_0 fails to build its decode "
        "graph with its AMX buffers on an AMX Xeon",
    )
    p.add_argument(
        "--evict",
        action="store_true",
        help="drop each contender's weight files (the project: its artifact cache too) from the "
        "page cache before its timed process: starts that read them from disk",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    p.add_argument("--convert-ct2", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("rounds", "reps", "threads", "prompt_len", "check_tokens", "min_identical"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 0 < args.new_tokens[0] < args.new_tokens[1]:
        p.error("--new-tokens: SHORT must be positive and below LONG")
    if any(b <= 0 for b in args.batches):
        p.error("--batches must be positive")
    for kv in args.project_env:
        if "=" not in kv:
            p.error(f"--project-env: {kv!r} is not KEY=VALUE")
    for v in args.variant:
        name, _, env = v.partition("=")
        if not name or not env or any("=" not in kv for kv in env.split(",")):
            p.error(f"--variant: {v!r} is not NAME=KEY=VALUE[,KEY=VALUE]")
    for kv in args.model_dirs:
        if kv.partition("=")[0] not in SIZES or not kv.partition("=")[2]:
            p.error(f"--model-dirs: {kv!r} is not SIZE=DIR with SIZE in {SIZES}")
    return args


def main(
    argv: Optional[list[str]] = None,
    runner: Callable = run_process,
    probe: Callable = probe_process,
) -> dict[str, Any]:
    """The benchmark; ``runner(job, env, timeout)`` runs one contender process and ``probe(args)``
    the bandwidth probe (replaced in tests)."""
    args = parse_args(argv)
    if args.convert_ct2:
        convert_ct2(Path(args.convert_ct2[0]), Path(args.convert_ct2[1]))
        return {}
    from models.tiny import default_cache_root

    work = Path(args.work_dir) if args.work_dir else default_cache_root().parent / "peers"
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    settings = {k: getattr(args, k) for k in SETTINGS}
    data = load_results(out, settings, args.fresh)
    project_env = dict(kv.split("=", 1) for kv in args.project_env)
    variants = {
        v.partition("=")[0]: dict(kv.split("=", 1) for kv in v.partition("=")[2].split(","))
        for v in args.variant
    }
    contenders = list(dict.fromkeys(["project_bf16", *args.contenders]))  # the reference first
    data.setdefault("models", {})
    data["skipped"] = {}  # said again by this run
    from experiments.bench.measure import make_prompts

    plan: dict[str, dict[str, Any]] = {}
    for size in args.sizes:
        folder = model_dir(size, dict(kv.split("=", 1) for kv in args.model_dirs))
        config = json.loads((folder / "config.json").read_text())
        data["models"][size] = {
            "dir": str(folder),
            "checkpoint_bytes": checkpoint_bytes(folder),
            "streamed_bytes": streamed_bytes(folder),
        }
        base = {
            "size": size,
            "model_dir": str(folder),
            "batches": args.batches,
            "prompts": {
                str(b): make_prompts(b, args.prompt_len, config["vocab_size"]) for b in args.batches
            },
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "check_tokens": args.check_tokens,
            "min_identical": args.min_identical,
            "reps": args.reps,
            "threads": args.threads,
            "level": args.level,
            "cache_dir": str(work / "artifacts"),
            "env_keys": list(ENV_KEYS),
            "llamacpp_extra_bufts": not args.llamacpp_no_extra_bufts,
            "evict": args.evict,
        }
        jobs = {}
        for c in contenders:
            miss = missing_packages(c)
            if miss:
                data["skipped"][c] = f"not installed: {', '.join(miss)}"
                continue
            job = dict(base, contender=c)
            try:
                if c == "llamacpp_bf16":
                    job["gguf"] = str(ensure_gguf(folder, "bf16", work))
                elif c == "llamacpp_q8_0":
                    job["gguf"] = str(ensure_gguf(folder, "q8_0", work))
                elif c == "ct2_int8":
                    job["ct2_dir"] = str(ensure_ct2(folder, work))
            except Exception as e:  # a peer that cannot be prepared is reported, not fatal
                data["skipped"][c] = f"{type(e).__name__}: {e}"[:2000]
                continue
            if c == "llamacpp_q8_0":
                data["models"][size]["q8_0_file_bytes"] = Path(job["gguf"]).stat().st_size
            jobs[c] = job
        for name in variants:
            for c in [c for c in list(jobs) if c.startswith("project")]:
                jobs[f"{c}@{name}"] = dict(jobs[c], name=f"{c}@{name}")
        plan[size] = jobs
    save(out, data)

    def env_for(c: str) -> dict[str, str]:
        kind, _, variant = c.partition("@")
        env = {"OMP_NUM_THREADS": str(args.threads)}
        if kind.startswith("project"):
            env.update(project_env)
            env.update(variants.get(variant, {}))
        return env

    # the reference tokens and compiled artifacts: the project's untimed preparation
    for size, jobs in plan.items():
        for c in ("project_bf16", "project_int8"):
            if c not in jobs:
                continue
            prep = [p for p in data["prepare"] if (p["size"], p["contender"]) == (size, c)]
            if not prep:
                log(f"[{size}] preparing {c} (compiles on a cold cache)")
                ref = data.get("reference", {}).get(size) if c != "project_bf16" else None
                try:
                    res = runner(
                        dict(jobs[c], reps=0, reference=ref, prepare=True),
                        env_for(c),
                        args.timeout,
                    )
                except Exception as e:
                    if c == "project_bf16":
                        raise  # no reference tokens: nothing can be checked
                    data["skipped"][c] = f"preparation failed: {str(e)[-2000:]}"
                    del jobs[c]
                    save(out, data)
                    continue
                data["prepare"].append(res)
                if c == "project_bf16":
                    data.setdefault("reference", {})[size] = {
                        b: row["tokens"] for b, row in res["batches"].items()
                    }
                save(out, data)
        for job in jobs.values():
            job["reference"] = data.get("reference", {}).get(size)

    data["probes"].append(dict(probe(args), when=time.strftime("%Y-%m-%d %H:%M:%S")))
    save(out, data)
    for r in range(args.rounds):
        for size, jobs in plan.items():
            names = list(jobs)
            k = r % len(names) if names else 0
            for c in names[k:] + names[:k]:
                if done(data, size, c, r):
                    continue
                log(f"[round {r}] {size} {c}")
                try:
                    res = runner(jobs[c], env_for(c), args.timeout)
                except Exception as e:  # reported, and the next contender runs
                    data.setdefault("failures", []).append(
                        {"size": size, "contender": c, "round": r, "error": str(e)[-3000:]}
                    )
                    save(out, data)
                    log(f"  FAILED: {str(e)[-500:]}")
                    continue
                res["round"] = r
                data["runs"].append(res)
                save(out, data)
                b1 = res["batches"].get(str(args.batches[0]), {})
                if b1.get("timed"):
                    log(
                        f"  b{args.batches[0]}: {b1['step_ms']:.2f} ms/step, start "
                        f"{res['start_s']:.2f} s"
                    )
    data["probes"].append(dict(probe(args), when=time.strftime("%Y-%m-%d %H:%M:%S")))
    summary = summarize(data)
    rat = ratios(summary, args.sizes, args.batches, data["runs"])
    fl = floors(summary, data, args.sizes)
    data["summary"] = summary
    data["ratios"] = rat
    data["floors"] = fl
    data["targets"] = bench_targets.peer_targets(summary, fl, data["models"])
    data["markdown"] = (
        markdown(data, summary, rat, fl)
        + "\n\n"
        + "\n".join(bench_targets.markdown(data["targets"]))
    )
    save(out, data)
    print(data["markdown"])
    return data


if __name__ == "__main__":
    main()
