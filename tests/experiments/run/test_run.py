"""experiments/run/job.py: prompts, agreement, pass toggles, cache redirection, the synthetic-task
accuracy path, tracking checks, and one real Inductor job end to end."""

import json
import os
import shutil

import pytest
import torch
from hydra_job_harness import TINY, compose_job, run_job_in_process
from omegaconf import OmegaConf

from experiments.run.compiler_env import compiler_caches_under, warm_up_compiler
from experiments.run.job_inputs import job_prompts, make_prompts, synthetic_task_of
from experiments.run.sweep import agreement
from experiments.run.trace import read_trace
from framework.engine.pass_cli import toggle_passes
from passes.registry import level_passes


def test_make_prompts_is_deterministic_and_in_bounds():
    workload = OmegaConf.create({"num_prompts": 5, "prompt_len_min": 3, "prompt_len_max": 9})
    a, b = make_prompts(workload, 100, seed=7), make_prompts(workload, 100, seed=7)
    assert a == b and len(a) == 5
    assert all(3 <= len(p) <= 9 and all(0 <= t < 100 for t in p) for p in a)
    assert make_prompts(workload, 100, seed=8) != a
    with pytest.raises(ValueError, match="prompt_len_min/max"):
        make_prompts(
            OmegaConf.create({"num_prompts": 1, "prompt_len_min": 5, "prompt_len_max": 4}),
            100,
            seed=0,
        )


def test_agreement_counts_tokens_up_to_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6]]
    logits = [torch.zeros(3), torch.ones(3)]
    same = agreement(ref, ref, logits, logits)
    assert same == {"token_agreement": 1.0, "max_logit_diff": 0.0, "outputs_equal": True}
    # prompt 0 diverges at token 2 (later equal tokens do not count), prompt 1 is one short
    out = agreement(
        [[1, 2, 9, 4], [5]], ref, [torch.zeros(3), torch.tensor([1.0, 1.5, 1.0])], logits
    )
    assert out["token_agreement"] == pytest.approx(3 / 6)
    assert out["max_logit_diff"] == pytest.approx(0.5) and out["outputs_equal"] is False


def test_eq_resolver_compares_scalars_and_containers():
    import experiments.run.job  # noqa: F401  registers ${eq:...}

    cfg = OmegaConf.create(
        {
            "level": 0,
            "passes": [],
            "q": None,
            "name": "O2",
            "a": "${eq:${level},0}",
            "b": "${eq:${passes},[]}",
            "c": "${eq:${q},null}",
            "d": "${eq:'${name}/${level}','O2/1'}",
        }
    )
    assert (cfg.a, cfg.b, cfg.c, cfg.d) == (True, True, True, False)


def test_ablation_sweep_is_every_registered_pass_once():
    from experiments.run.job import pass_toggle_sweep
    from passes.registry import canonical_order

    assert pass_toggle_sweep() == ",".join(["[]"] + [f"[{n}]" for n in canonical_order()])


def test_toggle_passes_flips_against_the_level_default_of_the_device():
    cpu_o2, cuda_o2 = level_passes(2, "cpu"), level_passes(2, "cuda")
    on_cpu_only = next(p for p in cpu_o2 if p not in cuda_o2)
    on_cuda_only = next(p for p in cuda_o2 if p not in cpu_o2)
    toggled = toggle_passes({}, [on_cpu_only, on_cuda_only], level=2, device_type="cpu")
    assert toggled["passes"] == [f"-{on_cpu_only}", f"+{on_cuda_only}"]
    toggled = toggle_passes({}, [on_cpu_only, on_cuda_only], level=2, device_type="cuda")
    assert toggled["passes"] == [f"+{on_cpu_only}", f"-{on_cuda_only}"]
    # an explicit pass list wins over the level's and stays an exact list
    toggled = toggle_passes(
        {"passes": ["noop_elimination", "fix_functionalization"]},
        ["noop_elimination", "fuse_add_rmsnorm"],
        level=2,
        device_type="cpu",
    )
    assert toggled["passes"] == ["fix_functionalization", "fuse_add_rmsnorm"]
    # edits of the level's list are kept; toggling an edited pass undoes the edit
    toggled = toggle_passes(
        {"passes": ["-noop_elimination", "+fuse_add_rmsnorm"]},
        ["fuse_add_rmsnorm", "fix_functionalization"],
        level=2,
        device_type="cpu",
    )
    assert toggled["passes"] == ["-noop_elimination", "-fix_functionalization"]
    assert toggle_passes({"passes": ["-noop_elimination"]}, ["noop_elimination"], 2, "cpu") == {
        "passes": None
    }


def test_compiler_caches_are_redirected_into_cache_dir_and_restored(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    with compiler_caches_under(str(tmp_path / "c")):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "inductor")
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "c" / "triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"
    assert "TRITON_CACHE_DIR" not in os.environ
    with compiler_caches_under(None):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"


@pytest.fixture
def synthetic_checkpoint(tmp_path):
    """The tiny test model dressed as a trained addition checkpoint (untrained weights: the
    exact match is near 0, but every step of the accuracy path runs)."""
    from models.tiny import ensure_tiny_model

    model = tmp_path / "addition"
    shutil.copytree(ensure_tiny_model(preset="test-llama"), model)
    (model / "metrics.json").write_text(json.dumps({"task": "addition"}))
    return model


def test_synthetic_checkpoints_get_task_prompts_others_random_ones(synthetic_checkpoint, tmp_path):
    from experiments.synthetic.task import get_task

    cfg = compose_job([*TINY, "cache_dir=null"])
    task = get_task("addition")
    assert synthetic_task_of(str(synthetic_checkpoint)) is task
    prompts, max_new, ignore_eos, answers = job_prompts(cfg, str(synthetic_checkpoint), 256)
    assert len(prompts) == len(answers) == 2
    assert all(len(p) == task.prompt_len for p in prompts)
    assert max_new == task.answer_len + 1 and ignore_eos is False
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.json").write_text(json.dumps({"task": "no-such-task"}))
    assert synthetic_task_of(str(tmp_path / "other")) is None
    prompts, max_new, ignore_eos, answers = job_prompts(cfg, str(tmp_path / "other"), 256)
    assert answers is None and max_new == 4 and ignore_eos is True


def test_job_on_a_synthetic_checkpoint_records_exact_match(synthetic_checkpoint, tmp_path):
    results = run_job_in_process(
        [*TINY, "compile=O0", "model=hf", f"model.path={synthetic_checkpoint}"], tmp_path / "job"
    )
    assert results["accuracy"]["n"] == 2
    # the score, recomputed outside the job: the same prompts through an eager LLM
    from experiments.synthetic.task import exact_match
    from framework import LLM

    cfg = compose_job([*TINY, "cache_dir=null"])
    prompts, max_new, ignore_eos, answers = job_prompts(cfg, str(synthetic_checkpoint), 256)
    outputs = LLM(str(synthetic_checkpoint), optimization_level=0, max_model_len=64).generate(
        prompts, max_new, ignore_eos=ignore_eos
    )
    assert results["accuracy"]["exact_match"] == exact_match(outputs, answers)
    first_step = read_trace(tmp_path / "job" / "trace.jsonl").steps[0]
    assert first_step.num_prefill_tokens == 2 * 8  # two "123+456=" prompts
    plain = run_job_in_process([*TINY, "compile=O0"], tmp_path / "plain")
    assert plain["accuracy"] is None


def test_tracking_is_checked_before_the_job_runs(tmp_path):
    try:
        import mlflow  # noqa: F401

        pytest.skip(reason="mlflow is installed: the missing-package error cannot occur")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install mlflow"):
        run_job_in_process([*TINY, "compile=O0", "tracking=mlflow"], tmp_path / "job")
    assert not (tmp_path / "job" / "results.json").exists()
    with pytest.raises(ValueError, match="tracking: unknown value 'wandb'"):
        run_job_in_process([*TINY, "compile=O0", "tracking=wandb"], tmp_path / "job")


def test_inductor_job_writes_the_full_results_contract(tmp_path):
    out = tmp_path / "job"
    results = run_job_in_process(
        [*TINY, "compile=O1", f"cache_dir={tmp_path / 'cache'}", "experiment_name=t"], out
    )
    assert results["experiment"] == "t" and "compile=O1" in results["overrides"]
    # pass statistics reach results.json under the names of the resolved pass list
    resolved = results["resolved_compilation"]["pass_config"]["passes"]
    assert set(results["passes"]) == set(resolved)
    assert all(rec["time_s"] > 0 for rec in results["passes"].values())
    assert sum(rec["matches"] for rec in results["passes"].values()) > 0, results["passes"]
    compile_ = results["compile"]
    assert compile_["pieces"] >= 1 and compile_["cache_misses"] >= 1
    assert compile_["warm_s"] is not None and compile_["warm_s"] < compile_["cold_s"]
    # Inductor's own cache went into the job's cache_dir (a cold compile, not a global hit)
    assert any((tmp_path / "cache" / "inductor").iterdir())
    # the process-wide compiler start-up is paid once, outside cold_s
    assert compile_["process_init_s"] is None or compile_["process_init_s"] > 0
    assert warm_up_compiler() is None
    assert results["agreement"]["token_agreement"] == 1.0  # fp32 O1 keeps the outputs
    trace = read_trace(out / "trace.jsonl")
    sizes = results["resolved_compilation"]["cudagraph_capture_sizes"]
    padded = [
        next((s for s in sorted(sizes) if s >= st.num_tokens), st.num_tokens) for st in trace.steps
    ]
    expected_waste = 1 - sum(st.num_tokens for st in trace.steps) / sum(padded)
    assert results["padding_waste"] == pytest.approx(expected_waste)
    assert sum(s.num_decode for s in trace.steps) + 2 == 2 * 4  # first tokens come from prefill
    assert json.loads((out / "results.json").read_text()) == results
