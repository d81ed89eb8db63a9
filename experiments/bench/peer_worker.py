"""The contenders of ``experiments.bench.peers``, each run in its own fresh process.

    python -m experiments.bench.peer_worker JOB.json      # prints one line: PEERS_RESULT {json}

A job names one contender, one model size, the batches and prompts, and (except for the
reference run) the project's bf16 greedy tokens to check against.  The worker loads the
contender (timing its start: the library's import plus the model's load), then per batch:

1. greedy tokens of ``check_tokens`` new tokens for every prompt, compared with the reference:
   an exact contender (bf16) is **not timed** when its median sequence differs before step
   ``min_identical`` (8; a misconfigured engine), else timed with its first diverging step per
   sequence reported (random weights have near-tied logits that rounding flips); a quantized
   one (int8, q8_0) is timed and its agreement reported;
2. ``reps`` times (alternating): a generation of ``new_tokens[1]`` and one of ``new_tokens[0]``
   new tokens from the same prompts; per step = (best long - best short) / (long - short).

It reports start times (and the time to the first two tokens: a contender that maps its
weights lazily pays their reads there), the fraction of its weight files the page cache held
before the load, per-batch results, peak RSS (``VmHWM``) after the load and at the end,
the page backing of its memory (``/proc/self/smaps_rollup``: anonymous huge pages, PMD-mapped
file pages), the CPU time the machine spent elsewhere while it ran (``/proc/stat``: other
processes' and the hypervisor's steal), and the load average.

Only the standard library (and :mod:`experiments.bench.process_facts`, which needs no more) is
imported at module level: a llama.cpp or CTranslate2 worker never imports torch, so its start
time and memory are its own.

Contenders (``KINDS``):
  project_bf16, project_int8   this project's ``LLM`` at O2 (int8: ``int8_per_token``)
  llamacpp_bf16, llamacpp_q8_0 llama.cpp through llama-cpp-python's low-level API: one
                               context with ``n_seq_max = batch``, one ``llama_decode`` per step
                               for all sequences, greedy argmax of the logits in numpy
  ct2_int8                     CTranslate2 ``Generator`` (int8 weights and compute; it has no
                               bf16 compute on CPU), greedy (``sampling_topk=1``)
  hf_eager                     transformers eager bf16, DynamicCache, greedy loop
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from experiments.bench.process_facts import (
    load_report,
    page_cache_report,
    proc_status,
    smaps_rollup,
    snapshot,
)

RESULT_MARK = "PEERS_RESULT "
KINDS = (
    "project_bf16",
    "project_int8",
    "llamacpp_bf16",
    "llamacpp_q8_0",
    "ct2_int8",
    "hf_eager",
)
EXACT = frozenset({"project_bf16", "llamacpp_bf16", "hf_eager"})
"""Contenders whose greedy tokens must equal the reference's to be timed."""


# ----------------------------------------------------------------------------- contenders
class Runner:
    """``generate(prompts, n) -> new tokens per prompt``: greedy, ``n`` new tokens, no EOS."""

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        raise NotImplementedError

    def prepare(self, batch: int) -> None:
        """Set up for batches of ``batch`` sequences (untimed)."""

    def close(self) -> None:
        pass


class ProjectRunner(Runner):
    def __init__(self, job: dict[str, Any], quantization: Any):
        import torch

        t = time.perf_counter()
        from framework import LLM, CompilationConfig

        self.import_framework_s = time.perf_counter() - t
        torch.set_num_threads(job["threads"])
        longest = job["prompt_len"] + max(job["new_tokens"] + [job["check_tokens"]]) + 8
        t = time.perf_counter()
        self.llm = LLM(
            job["model_dir"],
            dtype="bfloat16",
            quantization=quantization,
            max_num_seqs=max(job["batches"]),
            max_model_len=max(256, longest),
            cache_dir=job["cache_dir"],
            compilation_config=CompilationConfig(
                level=job.get("level", 2),
                progress_bar=False,
                compile_sizes=project_compile_sizes(os.environ),
                cpu_replay_max_tokens=project_cpu_replay(os.environ),
                cpu_replay_forward=os.environ.get(FORWARD_REPLAY_ENV, "1") != "0",
            ),
        )
        self.construct_s = time.perf_counter() - t
        self.decode_times: list[float] = []

    def generate(self, prompts, n):
        self.llm.runner.step_times["decode"].clear()
        out = self.llm.generate(prompts, max_new_tokens=n, ignore_eos=True)
        self.decode_times = list(self.llm.runner.step_times["decode"])
        return [list(map(int, row)) for row in out]

    def close(self):
        close = getattr(self.llm, "close", None)
        if close:
            close()


class LlamaCppRunner(Runner):
    """llama.cpp through llama-cpp-python's low-level ctypes API."""

    def __init__(self, job: dict[str, Any]):
        import llama_cpp as L

        self.L, self.job = L, job
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        if not job.get("llamacpp_extra_bufts", True):  # peers --llamacpp-no-extra-bufts
            mp.use_extra_bufts = False
        self.model = L.llama_model_load_from_file(job["gguf"].encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {job['gguf']}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.ctx = None
        self.batch_obj = None
        self.batch_size = 0
        self.prepare(job["batches"][0])  # the first batch's context is part of the start

    def prepare(self, batch: int) -> None:
        if batch == self.batch_size:
            return
        L, job = self.L, self.job
        self._free_ctx()
        self.batch_size = batch
        per_seq = (
            -(-(job["prompt_len"] + max(job["new_tokens"] + [job["check_tokens"]]) + 8) // 256)
            * 256
        )
        cp = L.llama_context_default_params()
        cp.n_ctx = per_seq * batch
        cp.n_batch = max(512, job["prompt_len"] * batch)
        cp.n_ubatch = 512
        cp.n_seq_max = batch
        cp.n_threads = cp.n_threads_batch = job["threads"]
        if hasattr(cp, "no_perf"):
            cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for batch {batch}")
        self.batch_obj = L.llama_batch_init(cp.n_batch, 0, 1)
        self.capacity = cp.n_batch

    def _free_ctx(self) -> None:
        if self.batch_obj is not None:
            self.L.llama_batch_free(self.batch_obj)
            self.batch_obj = None
        if self.ctx:
            self.L.llama_free(self.ctx)
            self.ctx = None

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits)."""
        b = self.batch_obj
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if logits else 0
        b.n_tokens = len(items)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, rows: int) -> list[int]:
        import numpy as np

        ptr = self.L.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def generate(self, prompts, n):
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        items = [
            (tok, pos, s, pos == len(p) - 1)
            for s, p in enumerate(prompts)
            for pos, tok in enumerate(p)
        ]
        if len(items) > self.capacity:
            raise RuntimeError(
                f"prompts of {len(items)} tokens exceed the batch of {self.capacity}"
            )
        self._decode(items)
        toks = self._argmax(len(prompts))
        out = [[t] for t in toks]
        for step in range(1, n):
            self._decode([(t, len(prompts[s]) + step - 1, s, True) for s, t in enumerate(toks)])
            toks = self._argmax(len(prompts))
            for row, t in zip(out, toks):
                row.append(t)
        return out

    def close(self):
        self._free_ctx()
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None


class CT2Runner(Runner):
    def __init__(self, job: dict[str, Any]):
        import ctranslate2

        self.gen = ctranslate2.Generator(
            job["ct2_dir"],
            device="cpu",
            compute_type=job.get("compute_type", "int8"),
            intra_threads=job["threads"],
            inter_threads=1,
        )
        vocab = json.loads((Path(job["ct2_dir"]) / "vocabulary.json").read_text())
        self.tokens = vocab

    def generate(self, prompts, n):
        start = [[self.tokens[t] for t in p] for p in prompts]
        res = self.gen.generate_batch(
            start,
            max_length=n,
            sampling_topk=1,
            include_prompt_in_result=False,
            end_token=[],
        )
        return [list(map(int, r.sequences_ids[0])) for r in res]


class HFEagerRunner(Runner):
    def __init__(self, job: dict[str, Any]):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(job["threads"])
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            job["model_dir"], dtype=torch.bfloat16
        ).eval()

    def generate(self, prompts, n):
        torch = self.torch
        from transformers import DynamicCache

        with torch.no_grad():
            cache = DynamicCache(config=self.model.config)
            ids = torch.tensor(prompts)
            out: list[list[int]] = [[] for _ in prompts]
            for _ in range(n):
                logits = self.model(
                    input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1
                ).logits
                toks = logits[:, -1].argmax(-1)
                for row, t in zip(out, toks.tolist()):
                    row.append(t)
                ids = toks.unsqueeze(1)
        return out


INT8_HEAD_ENV = "PIECEWISE_PEERS_INT8_HEAD"
"""``1``: ``project_int8`` quantizes the LM head too (``int8_per_token`` on every linear), as
the q8_0 GGUF holds ``output.weight`` in q8_0; by default the project leaves the head bf16 (33
of the tiny model's 57 MB a step).  A variant: ``--variant head=PIECEWISE_PEERS_INT8_HEAD=1``
runs ``project_int8@head`` beside ``project_int8``."""


def project_int8_quantization(env: Any) -> Any:
    """The quantization ``project_int8`` runs with (see :data:`INT8_HEAD_ENV`)."""
    if env.get(INT8_HEAD_ENV) == "1":
        return {"targets": {"lm_head": "int8_per_token", "re:.*": "int8_per_token"}}
    return "int8_per_token"


COMPILE_SIZES_ENV = "PIECEWISE_PEERS_COMPILE_SIZES"
"""Comma-separated compile sizes for the project's contenders (default: none, the level's).
A single size compiles the pieces for that exact token count: at batch 1 the kernels then
have static shapes, and Inductor opens no OpenMP region for them (the dynamic range's kernels
open one each: 33 regions and 80 work-sharing loops a decode step on the tiny model).  A variant:
``--variant cs1=PIECEWISE_PEERS_COMPILE_SIZES=1``."""


def project_compile_sizes(env: Any) -> Optional[list[int]]:
    """The compile sizes of :data:`COMPILE_SIZES_ENV`, or None (the level's default)."""
    raw = env.get(COMPILE_SIZES_ENV, "").strip()
    return [int(x) for x in raw.split(",") if x.strip()] if raw else None


CPU_REPLAY_ENV = "PIECEWISE_PEERS_CPU_REPLAY"
"""The project's ``CompilationConfig.cpu_replay_max_tokens`` (default: the config's): ``0``
runs every piece's Python instead of replaying its recorded native calls
(``backends/piecewise/replay.py``).  A variant: ``--variant norep=PIECEWISE_PEERS_CPU_REPLAY=0``
runs ``project_bf16@norep`` beside ``project_bf16``."""


def project_cpu_replay(env: Any) -> int:
    """The replay limit of :data:`CPU_REPLAY_ENV` (the config's default where unset)."""
    from framework.core.config import CompilationConfig

    raw = env.get(CPU_REPLAY_ENV, "").strip()
    return int(raw) if raw else CompilationConfig().cpu_replay_max_tokens


FORWARD_REPLAY_ENV = "PIECEWISE_PEERS_FORWARD_REPLAY"
"""``0``: the project's ``CompilationConfig.cpu_replay_forward`` off (each piece replays on
its own, the forward's Python between them runs; ``backends/piecewise/forward_replay.py``).
A variant: ``--variant nofwd=PIECEWISE_PEERS_FORWARD_REPLAY=0``."""


def build_runner(job: dict[str, Any]) -> Runner:
    kind = job["contender"]
    if kind == "project_bf16":
        return ProjectRunner(job, None)
    if kind == "project_int8":
        return ProjectRunner(job, project_int8_quantization(os.environ))
    if kind in ("llamacpp_bf16", "llamacpp_q8_0"):
        return LlamaCppRunner(job)
    if kind == "ct2_int8":
        return CT2Runner(job)
    if kind == "hf_eager":
        return HFEagerRunner(job)
    raise ValueError(f"unknown contender {kind!r}; contenders are {KINDS}")


# ----------------------------------------------------------------------------- measurement
def divergence_steps(tokens: list[list[int]], ref: list[list[int]]) -> list[int | None]:
    """Per reference sequence, the first step at which ``tokens`` differs (None: identical).

    A missing sequence diverges at step 0; a short one where it ends."""
    out: list[int | None] = []
    for i, rrow in enumerate(ref):
        row = tokens[i] if i < len(tokens) else []
        step = next((j for j, (a, b) in enumerate(zip(row, rrow)) if a != b), None)
        if step is None and len(row) < len(rrow):
            step = len(row)
        out.append(step)
    return out


def first_divergence(tokens: list[list[int]], ref: list[list[int]]) -> int | None:
    """The first step at which any sequence's token differs from the reference (None: none)."""
    bad = [s for s in divergence_steps(tokens, ref) if s is not None]
    if len(tokens) != len(ref):
        bad.append(0)
    return min(bad) if bad else None


def agrees_enough(steps: list[int | None], min_identical: int) -> bool:
    """Whether an exact (bf16) contender's tokens show it computes the same model.

    A misconfigured engine (wrong rope layout, wrong weights) leaves the reference within a
    step or two on every sequence. Two correct bf16 engines also part, later, wherever a
    random-weight model's top two logits are closer than their rounding differences. So the
    test is the median sequence: identical for at least ``min_identical`` steps."""
    if not steps:
        return False
    n = sorted(min_identical if s is None else s for s in steps)
    return n[len(n) // 2] >= min_identical


def time_batch(runner: Runner, prompts: list[list[int]], job: dict[str, Any]) -> dict[str, Any]:
    short, long_ = job["new_tokens"]
    t_long: list[float] = []
    t_short: list[float] = []
    decode_medians: list[float] = []
    for _ in range(job["reps"]):
        for n, sink in ((long_, t_long), (short, t_short)):
            t0 = time.perf_counter()
            out = runner.generate(prompts, n)
            sink.append(time.perf_counter() - t0)
            if any(len(row) != n for row in out):
                raise RuntimeError(
                    f"{job['contender']}: asked for {n} new tokens, got "
                    f"{sorted({len(r) for r in out})}"
                )
            times = getattr(runner, "decode_times", None)
            if n == long_ and times:
                s = sorted(times)
                decode_medians.append(s[len(s) // 2] * 1e3)
    per_step = [(a - b) / (long_ - short) * 1e3 for a, b in zip(t_long, t_short)]
    return {
        "step_ms": (min(t_long) - min(t_short)) / (long_ - short) * 1e3,
        "step_ms_pairs": per_step,
        "t_long_s": t_long,
        "t_short_s": t_short,
        **({"runner_decode_median_ms": decode_medians} if decode_medians else {}),
    }


def diagnose(runner: "ProjectRunner") -> dict[str, Any]:
    """Read rates in this process, right after its timing: the model's own tensors where they
    lie (weights in the pages they were given), and fresh buffers in 2 MB and 4 KB pages (what
    the machine allows just now).  A slow process whose fresh buffers read fast points at its
    weights' placement; one whose fresh buffers read slowly too, at the machine."""
    from experiments.bench import bandwidth

    model = runner.llm.model
    out: dict[str, Any] = {}
    try:
        tensors = list(model.parameters()) + list(model.buffers())
        out["weights"] = {
            k: v for k, v in bandwidth.read_tensors(tensors, repeats=5).items() if k != "seconds"
        }
        for huge in (True, False):
            row = bandwidth.read_once(
                256 << 20,
                threads=out["weights"]["threads"],
                repeats=5,
                method="prefetch",
                huge_pages=huge,
            )
            out["fresh_2mb" if huge else "fresh_4kb"] = row["best_gb_s"]
    except Exception as e:  # a diagnosis never fails the run
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def weight_files(job: dict[str, Any]) -> list[Path]:
    """The files a contender's load maps or reads its weights from.  The project's: the
    checkpoint (a warm start maps its processed-weights cache instead, whose fraction
    ``LLM.stats`` reports as ``weights_page_cache_frac``)."""
    if job["contender"].startswith("llamacpp"):
        return [Path(job["gguf"])] if job.get("gguf") else []
    if job["contender"].startswith("ct2"):
        return [Path(job["ct2_dir"]) / "model.bin"] if job.get("ct2_dir") else []
    return sorted(Path(job["model_dir"]).glob("*.safetensors")) if job.get("model_dir") else []


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    t_process = job.get("process_start")  # the launcher's time.time() before the spawn
    res: dict[str, Any] = {
        "contender": job.get("name", job["contender"]),  # "kind@variant" for a variant
        "size": job["size"],
        "pid": os.getpid(),
    }
    if t_process:
        res["spawn_to_worker_s"] = time.time() - t_process
    res["affinity"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    res["env"] = {k: os.environ[k] for k in job.get("env_keys", []) if k in os.environ}
    if job.get("evict") and not job.get("prepare"):  # peers --evict: the start reads from disk
        from framework.core.page_cache import evict_tree

        project = job["contender"].startswith("project")
        evict_tree(*weight_files(job), *([job["cache_dir"]] if project else []))
    res["page_cache_before_load"] = page_cache_report(weight_files(job))
    t0 = time.perf_counter()
    if job["contender"].startswith("project") or job["contender"] == "hf_eager":
        import torch  # noqa: F401  (the import's time is reported apart)
    res["import_torch_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    runner = build_runner(job)
    res["load_s"] = time.perf_counter() - t1
    res["start_s"] = time.perf_counter() - t0
    if isinstance(runner, ProjectRunner):
        res["framework_import_s"] = runner.import_framework_s
        res["construct_s"] = runner.construct_s
        res["warm_after_torch_s"] = runner.import_framework_s + runner.construct_s
        st = runner.llm.stats
        res["project_stats"] = {
            k: st.get(k)
            for k in (
                "load_s",
                "warm_restore_s",
                "compile_s",
                "dynamo_skipped",
                "cache_hits",
                "weights_cache",
                "weights_page_cache_frac",
            )
        }
    res["rss_after_load"] = proc_status()
    res["memory_backing_after_load"] = smaps_rollup()
    res["batches"] = {}
    before = snapshot()
    try:
        for batch in job["batches"]:
            prompts = job["prompts"][str(batch)]
            t_first = time.perf_counter()
            runner.prepare(batch)
            row: dict[str, Any] = {"batch": batch}
            runner.generate(prompts, 2)  # warm-up: first-call costs, compile-range loads
            row["first_generate_s"] = time.perf_counter() - t_first
            if "to_first_tokens_s" not in res:  # start + the first (2-token) generation
                res["to_first_tokens_s"] = time.perf_counter() - t0
            toks = runner.generate(prompts, job["check_tokens"])
            row["tokens"] = toks
            ref = (job.get("reference") or {}).get(str(batch))
            if ref is not None:
                steps = divergence_steps(toks, ref)
                div = first_divergence(toks, ref)
                row["tokens_match"] = div is None
                row["first_divergence"] = div
                row["divergence_steps"] = steps
                min_identical = int(job.get("min_identical", 8))
                if (
                    div is not None
                    and job["contender"] in EXACT
                    and not agrees_enough(steps, min_identical)
                ):
                    row["timed"] = False
                    row["why_not_timed"] = (
                        f"greedy tokens differ from the reference at step {div}, the median "
                        f"sequence before step {min_identical} (per sequence: {steps})"
                    )
                    res["batches"][str(batch)] = row
                    continue
            if job.get("prepare") or job["reps"] <= 0:
                row["timed"] = False
                row["why_not_timed"] = "preparation run"
            else:
                row.update(time_batch(runner, prompts, job))
                row["timed"] = True
            row["rss_after"] = proc_status()
            res["batches"][str(batch)] = row
        if isinstance(runner, ProjectRunner) and job.get("diagnose", True):
            res["diagnosis"] = diagnose(runner)
    finally:
        res["load"] = load_report(before, snapshot())
        runner.close()
    res["rss_end"] = proc_status()
    res["memory_backing_end"] = smaps_rollup()
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m experiments.bench.peer_worker JOB.json")
    job = json.loads(Path(argv[0]).read_text())
    res = run_job(job)
    sys.stdout.write(RESULT_MARK + json.dumps(res) + "\n")
    sys.stdout.flush()
    return res


if __name__ == "__main__":
    main()
