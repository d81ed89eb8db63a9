"""``verify_passes`` on real models: every built-in pass at every level passes on the tiny
families (no false positives, split or whole-graph), and a wrong out-of-tree pass is named
with its first diverging node, through ``LLM`` and through Hydra."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import FAMILIES

from framework import LLM, CompilationConfig, PassConfig
from models.tiny import ensure_tiny_model
from passes.verify import PassVerificationError

BROKEN = "broken_pass_example:SwapMulForAdd"
ROOT = Path(__file__).resolve().parents[2]


def _llm(path, level, cache_dir, dtype="float32", quantization=None, **compile_kw):
    return LLM(
        str(path),
        dtype=dtype,
        max_model_len=64,
        optimization_level=level,
        quantization=quantization,
        compilation_config=CompilationConfig(progress_bar=False, cache_dir=cache_dir, **compile_kw),
    )


def _check_all_verified(llm):
    passes = llm.stats["passes"]
    assert passes
    for name, rec in passes.items():
        assert rec["status"] == "ran", (name, rec["status"])
        # every run was checked: an error was measured after each pass on each graph
        assert rec["pieces"] and all(p["max_abs_error"] is not None for p in rec["pieces"]), name


@pytest.mark.parametrize("splitting_ops", [None, []], ids=["split", "whole_graph"])
def test_builtin_passes_verify_at_O2(llama_checkpoint, compile_cache_dir, splitting_ops, caplog):
    caplog.set_level(logging.WARNING, logger="framework.compile.build")
    kw = {} if splitting_ops is None else {"splitting_ops": splitting_ops}
    llm = _llm(
        llama_checkpoint, 2, compile_cache_dir, pass_config=PassConfig(verify_passes=True), **kw
    )
    _check_all_verified(llm)
    assert llm.generate([[1, 2, 3]], max_new_tokens=2)[0]
    ok = [r.getMessage() for r in caplog.records if "verify_passes: OK" in r.getMessage()]
    assert len(ok) == 1 and "max abs error" in ok[0], ok  # one line says the check passed


def test_wrong_oot_pass_is_named_with_its_first_diverging_node(llama_checkpoint, compile_cache_dir):
    with pytest.raises(PassVerificationError) as info:
        _llm(
            llama_checkpoint,
            2,
            compile_cache_dir,
            pass_config=PassConfig(passes=[f"+{BROKEN}"], verify_passes=True),
        )
    msg = str(info.value)
    # the verifier's own error, not Dynamo's wrapper: piece and range first, one short message
    assert re.match(r"verify_passes: piece submod_\d+, range_\d+-\d+: pass ", msg), msg
    assert "BackendCompilerFailed" not in msg and len(msg.splitlines()) <= 3
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert f"pass {BROKEN!r} changed the piece beyond tolerance" in msg
    # the pass kept the node (name mul_N) and changed its target
    assert re.search(r"first diverging node: mul_\d+ \(.*target=torch.ops.aten.add.Tensor\]", msg)


@pytest.mark.slow(reason="5 models x 3 levels x 2 splittings x 3 dtypes of Inductor compiles")
@pytest.mark.parametrize(
    "dtype,quantization", [("float32", None), ("bfloat16", None), ("bfloat16", "int8_per_token")]
)
@pytest.mark.parametrize("family", ("default",) + FAMILIES)
def test_every_level_verifies_on_every_family(
    tiny_checkpoint, tmp_path, family, dtype, quantization
):
    """``default`` is the tiny model of ``make run`` (8 layers, hidden 512); int8 quantization
    gives the quant fusions of O3 something to match."""
    path = ensure_tiny_model() if family == "default" else tiny_checkpoint(family)
    for level in (1, 2, 3):
        for kw in ({}, {"splitting_ops": []}):
            llm = _llm(
                path,
                level,
                str(tmp_path),
                dtype=dtype,
                quantization=quantization,
                pass_config=PassConfig(verify_passes=True),
                **kw,
            )
            _check_all_verified(llm)


EXTERNAL_EXPERIMENT = """\
# @package _global_
experiment_name: verify_broken
compile:
  pass_config:
    verify_passes: true
    passes: ["+broken_pass_example:SwapMulForAdd"]
"""


@pytest.mark.slow(reason="a Hydra job in a subprocess (~30 s)")
def test_hydra_run_names_the_wrong_pass_from_an_experiment_outside_the_repo(tmp_path):
    """The experiment file lives outside the repository and is found through Hydra's search
    path (passes/README.md, "Adding an experiment from outside the repo")."""
    conf = tmp_path / "my_conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "verify_broken.yaml").write_text(EXTERNAL_EXPERIMENT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "tests" / "passes"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        f"hydra.searchpath=[file://{conf}]",
        "experiment=verify_broken",
        "model.preset=test-llama",
        "workload.num_prompts=1",
        "workload.max_new_tokens=2",
        "check_agreement=false",
        "measure_warm_start=false",
        f"cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert f"pass '{BROKEN}' changed the piece beyond tolerance" in out, out[-3000:]
    assert re.search(r"first diverging node: mul_\d+ \(.*aten.add.Tensor", out), out[-3000:]
