"""The short pass list ``passes=[...]`` (framework/engine/pass_cli.py) through Hydra
composition."""

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra_job_harness import compose_job

from experiments.run.job import compilation_config
from framework.engine.pass_cli import parse_short
from passes.registry import level_passes, order_passes


def _resolved(*overrides):
    cfg = compose_job(["cache_dir=null", *overrides])
    cc = compilation_config(cfg).resolve(
        max_num_tokens=64, level_passes=level_passes, has_cuda=False
    )
    return cc.pass_config.passes


O2 = level_passes(2, "cpu")


def test_unset_is_the_levels_list():
    assert _resolved() == O2


def test_exact_list_is_exactly_those_passes():
    assert _resolved("passes=[noop_elimination,fix_functionalization]") == [
        "noop_elimination",
        "fix_functionalization",
    ]
    assert _resolved("passes=[]") == []


def test_plus_and_minus_edit_the_levels_list():
    assert _resolved("passes=[-noop_elimination]") == [p for p in O2 if p != "noop_elimination"]
    # a registered pass runs at its declared place, not the end (the pass manager orders)
    with_fusion = order_passes(_resolved("passes=[+fuse_rmsnorm_quant]"))
    assert set(with_fusion) == set(O2) | {"fuse_rmsnorm_quant"}
    assert with_fusion.index("fuse_rmsnorm_quant") < with_fusion.index("fix_functionalization")
    mixed = _resolved("passes=[+fuse_rmsnorm_quant,-noop_elimination]")
    assert "noop_elimination" not in mixed and "fuse_rmsnorm_quant" in mixed


def test_long_form_still_works_and_a_conflict_is_one_error():
    assert _resolved("compile.pass_config.passes=[-noop_elimination]") == [
        p for p in O2 if p != "noop_elimination"
    ]
    with pytest.raises(ValueError, match=r"compile.pass_config.passes are both set"):
        _resolved("passes=[+fuse_rmsnorm_quant]", "compile.pass_config.passes=[-noop_elimination]")


def test_bad_short_forms_are_named():
    with pytest.raises(ValueError, match="mixes exact names"):
        parse_short(["noop_elimination", "+fuse_add_rmsnorm"])
    with pytest.raises(ValueError, match="both added"):
        parse_short(["+x", "-x"])
    with pytest.raises(ValueError, match="expected a list"):
        parse_short("noop_elimination")


def test_a_sweep_over_short_forms_expands_to_one_job_each():
    parsed = OverridesParser.create().parse_overrides(["passes=[+my.mod:p],[-fuse_add_rmsnorm]"])
    jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    assert jobs == [["passes=[+my.mod\\:p]"], ["passes=[-fuse_add_rmsnorm]"]]  # Hydra escapes :
    cfg = compose_job(["cache_dir=null", *jobs[0]])
    pc = compilation_config(cfg).pass_config
    assert pc.passes == ["+my.mod:p"]
