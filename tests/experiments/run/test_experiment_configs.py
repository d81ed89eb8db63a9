"""Every file of conf/experiment/ composes, every job of its sweep is a valid configuration with
exactly one baseline, and one tiny job of it really runs.

The sweep of each file is expanded the way Hydra's basic sweeper expands it
(``BasicSweeper.split_arguments``), so a typo in a pass name, a quantization shorthand or a
size list fails here rather than in job 5 of a cluster sweep.
"""

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra_job_harness import CONF_DIR, TINY, compose_job, run_job_in_process
from omegaconf import OmegaConf

from experiments.run.cells import plan_cells
from experiments.run.job import compilation_config
from experiments.run.trace import read_trace, token_histogram
from experiments.tools.size_chooser import choose_sizes
from framework.core.quantization import SHORTHANDS, QuantizationConfig
from passes.registry import canonical_order, level_passes, resolve_pass

EXPERIMENT_DIR = CONF_DIR / "experiment"

# One fast job per experiment file (O0 or O1 with the eager compiler: no Inductor compile; the
# Inductor path is covered by tests/experiments/test_run.py). Never the baseline job, so the
# job exercises the swept setting.
SMOKE_JOBS = {
    "aa_noise": ["compile=O1", "compile.compiler=eager", "seed=1"],
    "ablate_levels": ["compile=O1", "compile.compiler=eager", "compile.pass_config.passes=[]"],
    "ablate_compile": ["compile=O1", "compile.compiler=eager", "compile.pass_config.passes=[]"],
    # O2 as the experiment sets it (eager adaptor: the passes run, nothing is compiled)
    "ablate_passes": ["compile.compiler=eager", "toggle_passes=[fuse_add_rmsnorm]"],
    "ablate_quant": ["compile=O0", "quantization=int8_per_channel_weight_only"],
    "sweep_sizes": ["compile=O0", "size_set=chosen_k4"],
    "bench_vs_hf": ["compile=O0", "workload.prompt_len_min=8", "workload.prompt_len_max=8"],
    "ablate_spec": ["compile=O0", "+spec_method=ngram", "spec_k=2", "workload.echo_len=24"],
}
CELLS = {"ablate_spec": 2}
"""Sweeps with one baseline per cell (experiments/run/cells.py): a baseline per method."""
EXPERIMENTS = sorted(p.stem for p in EXPERIMENT_DIR.glob("*.yaml"))
NO_CACHE = "cache_dir=null"  # ${hydra:runtime.output_dir} only resolves inside a job


def sweep_jobs(name: str) -> list[list[str]]:
    """The override lists of every job ``-m experiment=<name>`` launches."""
    cfg = compose_job([f"experiment={name}"], hydra_node=True)
    params = cfg.hydra.sweeper.params or {}
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def test_every_experiment_file_has_a_smoke_job():
    assert set(EXPERIMENTS) == set(SMOKE_JOBS), (
        "conf/experiment/ and SMOKE_JOBS differ: give every experiment file a tiny smoke job"
    )


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_file_is_global_package_with_its_name(name):
    text = (EXPERIMENT_DIR / f"{name}.yaml").read_text()
    assert text.splitlines()[0] == "# @package _global_"
    cfg = compose_job([f"experiment={name}", NO_CACHE])
    assert cfg.experiment_name == name
    # a fresh artifact cache per job: compile.cold_s must really be cold
    raw = OmegaConf.load(EXPERIMENT_DIR / f"{name}.yaml")
    assert OmegaConf.to_container(raw)["cache_dir"] == "${hydra:runtime.output_dir}/compile_cache"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_sweep_job_is_valid_and_exactly_one_is_the_baseline(name):
    """Exactly one baseline (one per cell for the sweeps in CELLS), and every job has one."""
    jobs = sweep_jobs(name)
    assert len(jobs) >= 2, f"{name}: a sweep needs at least two jobs"
    baselines, flags = [], []
    for overrides in jobs:
        cfg = compose_job([f"experiment={name}", NO_CACHE, *overrides])
        assert cfg.experiment_name == name
        cc = compilation_config(cfg)  # what the job builds, pass toggles applied
        for pass_name in cc.pass_config.passes or []:
            resolve_pass(pass_name.lstrip("+-"))  # raises on an unknown pass name
        QuantizationConfig.parse(OmegaConf.to_container(cfg, resolve=True)["quantization"])
        assert isinstance(cfg.baseline, bool)
        flags.append(cfg.baseline)
        if cfg.baseline:
            baselines.append(overrides)
    assert len(baselines) == CELLS.get(name, 1), f"{name}: baseline jobs {baselines}"
    maps = [dict(o.lstrip("+~").split("=", 1) for o in job) for job in jobs]
    plan = plan_cells(maps, flags)
    assert all(b is not None for b in plan.baseline_of), f"{name}: a job without a baseline"


def _sweep_configs(name: str) -> list:
    return [compose_job([f"experiment={name}", NO_CACHE, *job]) for job in sweep_jobs(name)]


def test_ablate_levels_sweeps_all_levels_with_O0_baseline():
    cfgs = _sweep_configs("ablate_levels")
    assert sorted(c.compile.level for c in cfgs) == [0, 1, 2, 3]
    assert [c.compile.level for c in cfgs if c.baseline] == [0]


def test_ablate_passes_flips_every_registered_pass_once_against_O2():
    cfgs = _sweep_configs("ablate_passes")
    assert {c.compile.level for c in cfgs} == {2}
    toggled = sorted(tuple(c.toggle_passes) for c in cfgs)
    assert toggled == sorted([()] + [(p,) for p in canonical_order()])
    o2 = set(level_passes(2, "cpu"))  # the jobs run on the CPU here
    for c in cfgs:
        passes = compilation_config(c).resolve(
            max_num_tokens=64, level_passes=level_passes, has_cuda=False
        )
        passes = passes.pass_config.passes
        flipped = set(c.toggle_passes)
        assert set(passes) == o2 ^ flipped, (list(c.toggle_passes), passes)
    # quantized, so the quant fusions have something to match
    assert {c.quantization for c in cfgs} == {"int8_per_token"}


def test_ablate_quant_covers_none_and_every_shorthand():
    cfgs = _sweep_configs("ablate_quant")
    assert sorted(map(str, (c.quantization for c in cfgs))) == sorted(["None", *SHORTHANDS])
    assert [c.quantization for c in cfgs if c.baseline] == [None]


def test_bench_vs_hf_is_the_benchmark_shape():
    cfgs = _sweep_configs("bench_vs_hf")
    assert {(c.compile.level, c.dtype, c.workload.num_prompts) for c in cfgs} == {
        (lvl, dt, b) for lvl in (0, 1, 2) for dt in ("float32", "bfloat16") for b in (1, 8)
    }
    assert {
        (c.workload.prompt_len_min, c.workload.prompt_len_max, c.workload.max_new_tokens)
        for c in cfgs
    } == {(64, 64, 32)}


def test_sweep_sizes_chosen_sets_are_the_choosers_answer_on_the_committed_trace():
    cfg = compose_job(["experiment=sweep_sizes", NO_CACHE])
    trace = read_trace(EXPERIMENT_DIR / "traces" / "sweep_sizes.jsonl")
    assert trace.max_num_tokens == cfg.max_num_batched_tokens
    hist = token_histogram(trace)
    for k in (4, 8):
        assert list(cfg.size_sets[f"chosen_k{k}"]) == choose_sizes(hist, k), (
            f"size_sets.chosen_k{k} is stale: rerun experiments.tools.size_chooser on the trace "
            f"(commands in conf/experiment/sweep_sizes.yaml)"
        )
    cfgs = _sweep_configs("sweep_sizes")
    pairs = {(c.size_set, c.compile_size_set) for c in cfgs}
    assert pairs == {
        (s, c) for s in ("default", "pow2", "chosen_k4", "chosen_k8") for c in ("none", "chosen_k4")
    }
    chosen = next(c for c in cfgs if c.size_set == "chosen_k8" and c.compile_size_set == "none")
    assert list(chosen.compile.cudagraph_capture_sizes) == cfg.size_sets.chosen_k8
    assert list(chosen.compile.compile_sizes) == []


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_one_tiny_job_runs(name, tmp_path):
    results = run_job_in_process([f"experiment={name}", *TINY, *SMOKE_JOBS[name]], tmp_path / name)
    assert results["experiment"] == name
    assert results["baseline"] is False
    assert results["latency_ms"]["decode"]["median"] > 0
    assert results["tokens_per_s"] > 0
    if name in ("ablate_levels", "sweep_sizes", "bench_vs_hf", "ablate_spec"):  # fp32, plain
        assert results["agreement"]["token_agreement"] == 1.0
    else:  # quantized or fused: may differ from the baseline, never everywhere
        assert 0.5 <= results["agreement"]["token_agreement"] <= 1.0
    # the per-job artifact cache lives in the job folder
    assert results["config"]["cache_dir"] == str(tmp_path / name / "compile_cache")
    assert (tmp_path / name / "trace.jsonl").is_file()
    if name == "sweep_sizes":
        assert results["capture_sizes"] == [8, 34, 77, 128]
        assert 0.0 <= results["padding_waste"] < 1.0
    if name == "ablate_quant":
        assert results["config"]["quantization"] == "int8_per_channel_weight_only"
    if name == "bench_vs_hf":
        assert results["config"]["dtype"] == "bfloat16"
    if name == "ablate_spec":  # n-gram drafts on the copy workload, verified
        assert results["stats"]["spec_method"] == "ngram"
        assert results["stats"]["spec_num_speculative_tokens"] == 2
        assert results["stats"]["spec_verify_chunks"] > 0
        assert 0.0 <= results["workload_copy"]["copy_fraction"] <= 1.0


@pytest.mark.slow  # ~20 s: 24 prompts through the scheduler; guards a committed data file
def test_committed_sweep_sizes_trace_is_the_trace_of_its_workload(tmp_path):
    """The scheduler still produces the committed trace for sweep_sizes' workload (else the
    chosen_k* sets are tuned for a workload that no longer exists: regenerate them)."""
    run_job_in_process(
        ["experiment=sweep_sizes", "compile=O0", "check_agreement=false", "num_threads=1"],
        tmp_path / "job",
    )
    fields = ("num_tokens", "num_reqs", "num_decode", "num_prefill_tokens")
    steps = lambda trace: [tuple(getattr(s, f) for f in fields) for s in trace.steps]  # noqa
    assert steps(read_trace(tmp_path / "job" / "trace.jsonl")) == steps(
        read_trace(EXPERIMENT_DIR / "traces" / "sweep_sizes.jsonl")
    )


ABLATE_FAST = [*TINY, "compile.compiler=eager", "check_agreement=false", "rounds=2"]
"""The ablate_passes job at O2 as the experiment sets it, with the eager adaptor (the passes
run on every piece, nothing is compiled by Inductor)."""


@pytest.fixture(scope="module")
def ablate_passes_baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("ablate_passes") / "baseline"
    return run_job_in_process(["experiment=ablate_passes", *ABLATE_FAST, "toggle_passes=[]"], out)


FAST_TOGGLES = ("noop_elimination", "prepack_linear")
"""The toggles ``make test`` runs (a pass O2 runs, and the one that changes the most); every
other registered pass's job (about 12 s each) runs under ``make test-all``."""


def _toggle_param(toggles: list[str]):
    fast = any(f"[{name}]" in toggles[0] for name in FAST_TOGGLES)
    marks = () if fast else (pytest.mark.slow(reason="one ablate_passes job each (~12 s)"),)
    return pytest.param(toggles, marks=marks, id=str(toggles))


@pytest.mark.parametrize(
    "toggles",
    [_toggle_param(t) for t in sweep_jobs("ablate_passes") if t != ["toggle_passes=[]"]],
)
def test_ablate_passes_each_toggle_changes_that_pass_record(
    toggles, ablate_passes_baseline, tmp_path
):
    """At O2 (where passes run) each job of the sweep flips one pass, and that pass's record
    changes: it ran in exactly one of the baseline and the toggled job, and nothing else
    changed."""
    base = ablate_passes_baseline
    toggled = run_job_in_process(["experiment=ablate_passes", *ABLATE_FAST, *toggles], tmp_path)
    (name,) = compose_job(["experiment=ablate_passes", NO_CACHE, *toggles]).toggle_passes
    assert base["baseline"] is True and toggled["baseline"] is False
    assert base["resolved_compilation"]["level"] == 2 == toggled["resolved_compilation"]["level"]
    ran = [name in r["passes"] for r in (base, toggled)]
    assert ran[0] != ran[1], (name, base["passes"], toggled["passes"])
    assert set(base["passes"]) ^ set(toggled["passes"]) == {name}
    with_pass = base if ran[0] else toggled
    if name == "sequence_parallelism":  # one process, no concrete compile size >= threshold
        assert with_pass["passes"][name]["status"] == "skipped"
    else:
        assert with_pass["passes"][name]["status"] == "ran"
    if name in ("sequence_parallelism", "fuse_allreduce_rmsnorm"):  # no all-reduce at TP=1
        assert name in toggled["unmatched_fusions"] or with_pass["passes"][name]["matches"] in (
            0,
            None,
        )
    if name == "fuse_add_rmsnorm":
        assert with_pass["passes"][name]["matches"] > 0  # it has something to do here
    if name == "noop_elimination":
        # The int8 layers of this sweep are single packed ops (the per-token quantisation is
        # inside the op), so the pieces hold none of the no-op views/slices the plain int8
        # path had: the pass runs and records its (zero) count.
        assert isinstance(with_pass["passes"][name]["matches"], int)
    if name == "fuse_qk_norm_rope":  # a Llama has no q/k norms: the zero match is reported
        assert "fuse_qk_norm_rope" in toggled["unmatched_fusions"]
        assert "fuse_qk_norm_rope" not in base["unmatched_fusions"]
    # timed in rounds, samples kept
    assert toggled["rounds"]["n"] == 2 and len(toggled["rounds"]["samples"]["wall_s"]) == 2
