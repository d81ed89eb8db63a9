"""A warm start without the compiler: on a cache hit, in a fresh process, ``LLM(...)`` loads
the pieces' lean artifacts (backends/piecewise/inductor_lean.py) without importing Inductor's
compile path, without a Dynamo trace and without Inductor's ISA probing, and generates the
cold run's tokens.  Neither Dynamo nor Inductor is imported at all."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [[3, 17, 42, 9, 100], [8, 1, 250]]

SCRIPT = textwrap.dedent(
    """
    import json, sys, time, traceback
    import torch
    torch.set_num_threads(1)
    importers = {}

    class Spy:  # records the project frame that first imports these modules
        WATCH = ("torch._dynamo", "torch._inductor", "transformers", "sympy")

        def find_spec(self, name, path=None, target=None):
            if name in self.WATCH and name not in importers:
                frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                          and "importlib" not in f.filename]
                importers[name] = [f"{f.filename}:{f.name}" for f in frames[-3:]]
            return None

    sys.meta_path.insert(0, Spy())
    from framework import LLM, CompilationConfig
    path, cache = sys.argv[1:3]
    t0 = time.perf_counter()
    llm = LLM(path, optimization_level=2, cache_dir=cache, max_num_seqs=2, max_model_len=64,
              compilation_config=CompilationConfig(progress_bar=False))
    construct_s = time.perf_counter() - t0
    modules = set(sys.modules)
    isa = sys.modules.get("torch._inductor.cpu_vec_isa")
    probed = isa is not None and isa.valid_vec_isa_list.cache_info().currsize > 0
    out = llm.generate(%r, 8, ignore_eos=True)
    s = llm.stats
    runtimes = llm.compiled.backend.runtimes.values()
    split = llm.runner.forward.compiled_fn  # the split module the warm start rebuilt
    # an op bound to its direct kernel is called through a switch that names it (.op)
    targets = [str(getattr(n.target, "op", n.target)) for n in split.graph.nodes
               if n.op == "call_function"]
    direct = sum(hasattr(n.target, "op") for n in split.graph.nodes if n.op == "call_function")
    print("RESULT" + json.dumps({
        "split_modules": sum(n.op == "call_module" for n in split.graph.nodes),
        "attention_calls": targets.count("piecewise.attention.default"), "direct": direct,
        "pieces": len(llm.compiled.backend.runtimes), "layers": llm.model_config.num_layers,
        "out": out, "construct_s": construct_s, "traces": s["dynamo_traces"],
        "compiles": s["compile_compiles"], "loads": s["compile_loads"],
        "compile_fx": "torch._inductor.compile_fx" in modules,
        "aot_autograd": "torch._functorch.aot_autograd" in modules,
        "dynamo": "torch._dynamo" in modules, "inductor": "torch._inductor" in modules,
        "transformers": "transformers" in modules, "sympy": "sympy" in modules,
        "importers": importers, "isa_probed": probed,
        "lean": all(getattr(e.runnable, "lean", False)
                    for r in runtimes for e in r.entries.values()),
    }))
"""
    % (PROMPTS,)
)


def run(ckpt: Path, cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", SCRIPT, str(ckpt), str(cache)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def test_warm_start_loads_without_the_compiler(llama_checkpoint, tmp_path):
    cold = run(llama_checkpoint, tmp_path)
    assert cold["compiles"] > 0 and cold["traces"] == 1
    warm = run(llama_checkpoint, tmp_path)
    assert warm["out"] == cold["out"]
    assert (warm["traces"], warm["compiles"]) == (0, 0), warm
    assert warm["loads"] == cold["compiles"]
    assert warm["lean"], "every piece should run its lean artifact"
    # both runs call attention from the split module's code, not through a submodule each,
    # and without the dispatcher (bind_direct_splitting_ops)
    for run_ in (cold, warm):
        assert run_["attention_calls"] == run_["layers"] == run_["direct"], run_
        assert run_["split_modules"] == run_["pieces"], run_
    assert not warm["compile_fx"], "a warm start must not import Inductor's compile path"
    assert not warm["aot_autograd"]
    assert not warm["isa_probed"], "Inductor's vector-ISA probing ran on a warm start"
    # The cache key's Inductor factors come from the memo the cold run wrote
    # (framework/cache/factor_memo.py), so nothing imports Inductor or Dynamo.
    assert not warm["dynamo"], f"torch._dynamo imported by {warm['importers']}"
    assert not warm["inductor"], f"torch._inductor imported by {warm['importers']}"
    # A folder without tokenizer files needs neither transformers (~1 s to import) nor sympy
    assert not warm["transformers"] and not warm["sympy"], warm


def test_memoized_inductor_factors_equal_the_computed_ones(tmp_path):
    """The memo written by a process that had not imported Inductor holds what this process
    computes directly (same environment, default Inductor config)."""
    from framework.cache.factor_memo import MEMO_DIR, inductor_side_factors

    code = (
        "import sys, json; from framework.cache.factor_memo import inductor_side_factors;"
        f"inductor_side_factors({str(tmp_path)!r})"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (memo,) = (tmp_path / MEMO_DIR).glob("*.json")
    direct = json.loads(json.dumps(inductor_side_factors(None)))
    assert json.loads(memo.read_text()) == direct
