"""Tensor parallelism through the real engine: TP=2 on gloo (two processes) against TP=1.

Each TP=2 LLM spawns one worker process (~10 s on this machine), so the family sweep runs at
O0; one test compiles (O2).  Greedy fp32 tokens must be identical and the first-token logits
close (the all-reduce changes the summation order, so not bit-identical).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from process_group_harness import group_alive, run_script

from framework.engine.executor import TensorParallelExecutor
from framework.engine.llm import LLM
from framework.engine.observers import FirstTokenLogits
from framework.engine.parallel import FAIL_HOOK_ENV, TensorParallelError
from framework.engine.sampler import Sampler
from models.tiny import write_tiny_checkpoint

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def mqa_checkpoint(tmp_path_factory):
    """1 KV head (< TP) and a vocabulary of 251 (not divisible by 2)."""
    root = tmp_path_factory.mktemp("ckpt-mqa")
    return write_tiny_checkpoint(
        root / "mqa", "test-llama", seed=1, num_key_value_heads=1, vocab_size=251
    )


def _generate(path, tp: int, **kw):
    llm = LLM(str(path), tensor_parallel_size=tp, max_model_len=128, **kw)
    try:
        with FirstTokenLogits.attached(llm) as first:
            toks = llm.generate(PROMPTS, max_new_tokens=6)
        return toks, first.take(), llm
    finally:
        llm.close()


def _assert_same(path, **kw):
    torch.set_num_threads(1)
    ref, ref_logits, _ = _generate(path, 1, **kw)
    out, logits, llm = _generate(path, 2, **kw)
    assert out == ref
    for a, b in zip(logits, ref_logits):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(p.exitcode == 0 for p in llm._tp.workers)  # close() joined them cleanly
    return llm


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_tp2_tokens_equal_tp1_o0(tiny_checkpoint, family):
    _assert_same(tiny_checkpoint(family), optimization_level=0)


def test_tp2_mqa_odd_vocab_o0(mqa_checkpoint):
    llm = _assert_same(mqa_checkpoint, optimization_level=0)
    # This rank's shard: 2 of 4 q heads, the single KV head replicated, padded vocab 252/2.
    attn = llm.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert llm.model.lm_head.weight.shape[0] == 126
    assert next(iter(llm.kv_caches.values())).shape[-2:] == (1, 16)
    # Tensor parallelism is an executor over rank 0's worker, not a patch on its runner.
    assert isinstance(llm.executor, TensorParallelExecutor) and llm.executor.worker is llm.worker
    assert "execute" not in vars(llm.runner) and isinstance(llm.runner.sampler, Sampler)


@pytest.mark.slow  # reason: two cold O2 compiles (~2 min); tests/passes/test_tp_passes.py is
# the O2 TP=2 test of `make test` (passes on); this one is the passes-off counterpart.
def test_tp2_o2_tokens_equal_tp1_and_collectives_in_graph(mqa_checkpoint, tmp_path):
    dump = tmp_path / "dump"
    cc = {"level": 2, "debug_dump_path": str(dump)}
    llm = _assert_same(mqa_checkpoint, compilation_config=cc, cache_dir=str(tmp_path / "c"))
    # The TP=2 trace (rank 0's folder) holds the all-reduces as functional collectives: one
    # for the embedding and two per layer, and the split is unchanged (2 attention ops).
    assert "_c10d_functional" not in (dump / "split_graph.py").read_text()  # TP=1's
    code = (dump / "rank_0" / "split_graph.py").read_text()
    assert code.count("_c10d_functional.all_reduce") == 1 + 2 * 2
    assert code.count("_c10d_functional.wait_tensor") == 1 + 2 * 2
    assert llm.stats["compile_num_splitting_ops"] == 2
    assert "/rank_0/" in llm.stats["cache_dir"] + "/"


@pytest.mark.parametrize("rank", [1, 0])
def test_step_failure_names_rank_and_leaves_no_process(llama_checkpoint, monkeypatch, rank):
    monkeypatch.setenv(FAIL_HOOK_ENV, f"{rank}:2")  # the rank raises at its second step
    llm = LLM(str(llama_checkpoint), tensor_parallel_size=2, max_model_len=128)
    with pytest.raises(TensorParallelError, match=f"rank {rank} failed") as info:
        llm.generate(PROMPTS, max_new_tokens=4)
    assert FAIL_HOOK_ENV in str(info.value)  # the failed rank's traceback is in the message
    assert all(p.exitcode is not None for p in llm._tp.workers)
    assert not [p for p in mp.active_children() if p.name.startswith("piecewise-tp")]
    with pytest.raises(TensorParallelError, match="closed"):
        llm.generate(PROMPTS, max_new_tokens=1)


@pytest.mark.parametrize("rank", [1, 0])
def test_startup_failure_names_rank_and_leaves_no_process(llama_checkpoint, monkeypatch, rank):
    """A rank that fails during start-up at O1 (after the handshake, before the warm-up
    compile whose forward runs the collectives): one error naming it, no process left.
    (Before: a worker's failure surfaced on rank 0 as the raw gloo error of the warm-up's
    all-reduce, and rank 0's own failure left the worker waiting in a collective.)"""
    monkeypatch.setenv(FAIL_HOOK_ENV, f"{rank}:startup")
    cc = {"level": 1, "compiler": "eager"}  # the O1 start-up path, without Inductor's cost
    with pytest.raises(TensorParallelError, match=f"rank {rank} failed") as info:
        LLM(str(llama_checkpoint), tensor_parallel_size=2, max_model_len=128, compilation_config=cc)
    assert f"{FAIL_HOOK_ENV} test hook: rank {rank} raises at start-up" in str(info.value)
    assert "Traceback" in str(info.value)
    assert not [p for p in mp.active_children() if p.name.startswith("piecewise-tp")]


def test_torchrun_ranks_serve_rank0_and_exit_cleanly(mqa_checkpoint):
    """``torchrun --nproc_per_node 2``: both ranks run the script, join torchrun's group (gloo)
    instead of spawning, rank 1 serves rank 0's steps inside ``LLM(...)`` and exits when rank 0
    closes; tokens equal TP=1 and every process ends with status 0.  (Before: rank 0's close
    sent no stop message to ranks it had not spawned, so rank 1 died in its next collective
    when rank 0 left: exit 1.)"""
    torch.set_num_threads(1)
    ref = LLM(str(mqa_checkpoint), optimization_level=0, max_model_len=128)
    expected = ref.generate(PROMPTS, max_new_tokens=4)
    script = Path(__file__).with_name("torchrun_generate.py")
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    args += [str(script), str(mqa_checkpoint), json.dumps(PROMPTS), "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIECEWISE_TP_TIMEOUT_S": "60"}
    done = run_script(args, timeout_s=240, env=env)
    assert done.returncode == 0, done.stdout[-4000:]
    results = [
        json.loads(ln[len("RESULT ") :])
        for ln in done.stdout.splitlines()
        if ln.startswith("RESULT ")
    ]
    assert results == [{"rank": 0, "tokens": expected}]  # the script's tail ran on rank 0 only
    assert not group_alive(done.pid)


def test_tensor_parallel_size_is_validated(llama_checkpoint):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(llama_checkpoint), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide"):
        LLM(str(llama_checkpoint), tensor_parallel_size=3)


# ---------------------------------------------------------------- engines own their group
@pytest.mark.slow  # reason: a TP=2 start-up (spawn, ~10 s) plus three TP=1 LLMs
def test_tp1_and_tp2_llms_alternate(tiny_checkpoint, mqa_checkpoint, compile_cache_dir):
    """A TP=1 (O1) and a TP=2 (O0) LLM of different models, alive together, generate
    alternately: each one's tokens equal what it produced alone; the TP=1 one joins no
    group."""
    torch.set_num_threads(1)
    one = LLM(
        str(tiny_checkpoint("qwen3")),
        compilation_config={"level": 1, "compiler": "eager"},
        cache_dir=compile_cache_dir,
        max_model_len=128,
    )
    one_ref = one.generate(PROMPTS, max_new_tokens=6)
    two_ref = LLM(str(mqa_checkpoint), optimization_level=0, max_model_len=128).generate(
        PROMPTS, max_new_tokens=6
    )
    two = LLM(str(mqa_checkpoint), tensor_parallel_size=2, optimization_level=0, max_model_len=128)
    try:
        for _ in range(3):
            assert two.generate(PROMPTS, max_new_tokens=6) == two_ref
            assert one.generate(PROMPTS, max_new_tokens=6) == one_ref
        assert one._tp is None and one.worker.tp.world_size == 1
    finally:
        two.close()


@pytest.mark.slow  # reason: a TP=2 start-up and a cold O2 compile (~1 min)
def test_tp1_after_tp2_without_close(mqa_checkpoint, tmp_path):
    """TP=1 (O0) -> TP=2 -> TP=1 (O2) in one process, no close(): the third is built as
    rank 0 of 1, not as a rank of the TP=2 group (before: deadlock in its warm-up)."""
    torch.set_num_threads(1)
    kw = dict(max_model_len=128)
    ref = LLM(str(mqa_checkpoint), optimization_level=0, **kw).generate(PROMPTS, max_new_tokens=6)
    tp2 = LLM(str(mqa_checkpoint), tensor_parallel_size=2, optimization_level=0, **kw)
    assert tp2.generate(PROMPTS, max_new_tokens=6) == ref
    o2 = LLM(str(mqa_checkpoint), optimization_level=2, cache_dir=str(tmp_path), **kw)
    assert o2.generate(PROMPTS, max_new_tokens=6) == ref
    head = o2.model.lm_head  # its weight is packed (prepack_linear): check the logical rows
    assert o2.worker.tp.world_size == 1 and head.tp_size == 1 and head.out_features == 251
    assert tp2.generate(PROMPTS, max_new_tokens=6) == ref  # the TP=2 one still works
    tp2.close()


# ---------------------------------------------------------------- failing fast, saying why
def _script_env(tmp_path) -> dict:
    root = str(Path(__file__).resolve().parents[3])
    return {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }


def _group_gone(pgid: int, wait_s: float = 30) -> bool:
    """No process of the group left (the resource tracker ends a moment after its parent)."""
    end = time.monotonic() + wait_s
    while group_alive(pgid) and time.monotonic() < end:
        time.sleep(0.2)
    return not group_alive(pgid)


def _store_files(tmp_path) -> list:
    return sorted(p.name for p in tmp_path.glob("piecewise-tp-*"))


@pytest.mark.slow  # reason: two interpreter start-ups importing torch (~15 s); the fast
# test_worker_exiting_at_startup_ends_it_with_its_stderr covers the same start-up watch.
def test_unguarded_script_fails_fast_and_says_to_guard_it(llama_checkpoint, tmp_path):
    """A script without ``if __name__ == "__main__":``: the spawned rank dies of Python's
    bootstrapping error at once; start-up ends within seconds saying to guard the script,
    with that rank's stderr, and leaves no rendezvous file (before: rank 0 waited the full
    PIECEWISE_TP_TIMEOUT_S, then said only "exited with code 1")."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys\n"
        "from framework.engine.llm import LLM\n"
        "llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=64)\n"
        "print('BUILT', flush=True)\n"
    )
    t0 = time.monotonic()
    env = _script_env(tmp_path)
    done = run_script([str(script), str(llama_checkpoint)], timeout_s=120, env=env)
    assert done.returncode != 0 and "BUILT" not in done.stdout
    assert time.monotonic() - t0 < 90
    assert "TensorParallelError: tensor parallel rank 1 failed" in done.stdout
    assert 'if __name__ == "__main__":' in done.stdout
    assert "bootstrapping phase" in done.stdout  # the worker's own stderr, in the message
    assert _store_files(tmp_path) == []
    assert _group_gone(done.pid)


def test_worker_exiting_at_startup_ends_it_with_its_stderr(llama_checkpoint, tmp_path):
    """A worker process that exits before it joins the group (here: its import of the main
    module exits 3) ends start-up at once with its exit code and stderr tail."""
    script = tmp_path / "worker_exits.py"
    script.write_text(
        "import sys\n"
        "if __name__ == '__mp_main__':\n"
        "    sys.stderr.write('WORKER-SAYS-BOOM\\n')\n"
        "    sys.exit(3)\n"
        "from framework.engine.llm import LLM\n"
        "if __name__ == '__main__':\n"
        "    LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=64)\n"
        "    print('BUILT', flush=True)\n"
    )
    t0 = time.monotonic()
    env = _script_env(tmp_path)
    done = run_script([str(script), str(llama_checkpoint)], timeout_s=120, env=env)
    assert done.returncode != 0 and "BUILT" not in done.stdout
    assert time.monotonic() - t0 < 90
    msg = done.stdout[done.stdout.index("TensorParallelError") :]
    assert "rank 1 failed" in msg and "exited with code 3" in msg
    assert "WORKER-SAYS-BOOM" in msg
    assert 'if __name__ == "__main__":' not in msg  # not the bootstrapping error
    assert _store_files(tmp_path) == []


def test_after_a_rank_failed_the_error_names_the_failure(llama_checkpoint, monkeypatch):
    """Using the LLM after a rank died repeats the true cause (before: "LLM.close() ran",
    though it did not)."""
    monkeypatch.setenv(FAIL_HOOK_ENV, "1:2")
    llm = LLM(str(llama_checkpoint), tensor_parallel_size=2, max_model_len=128)
    with pytest.raises(TensorParallelError, match="rank 1 failed"):
        llm.generate(PROMPTS, max_new_tokens=4)
    with pytest.raises(TensorParallelError) as info:
        llm.generate(PROMPTS, max_new_tokens=1)
    assert "LLM.close() ran" not in str(info.value)
    assert "rank 1 failed" in str(info.value) and FAIL_HOOK_ENV in str(info.value)


def test_sigterm_removes_the_store_file_and_the_workers(llama_checkpoint, tmp_path):
    """SIGTERM to rank 0 while the group runs: the ``piecewise-tp-*`` rendezvous file is
    removed and no worker is left (before: the file stayed in the temp directory)."""
    script = tmp_path / "serve.py"
    script.write_text(
        "import sys, time\n"
        "from framework.engine.llm import LLM\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=64)\n"
        "    print('READY', flush=True)\n"
        "    time.sleep(300)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script), str(llama_checkpoint)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_script_env(tmp_path),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("READY") or not line:
                break
        assert lines[-1].startswith("READY"), "".join(lines)[-4000:]
        assert len(_store_files(tmp_path)) == 1  # the group's rendezvous file
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGTERM  # SIGTERM's own effect is kept
        assert _store_files(tmp_path) == []
        assert _group_gone(proc.pid)
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
