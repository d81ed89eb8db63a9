"""Strict configs: one ValueError naming the field, level defaults only for unset fields,
hashes that ignore paths and logging."""

import pytest

from framework.core.config import (
    CompilationConfig,
    CompilationMode,
    PassConfig,
    default_capture_sizes,
)
from framework.core.forward_context import CUDAGraphMode


def level_passes(level: int, device_type: str) -> list[str]:
    """A stand-in for passes.registry.level_passes (core may not know the passes): what
    resolve() gets is what it fills in, per level and device type."""
    return [] if level == 0 else [f"pass_o{level}_{device_type}"]


@pytest.mark.parametrize(
    "data,field",
    [
        ({"levle": 2}, "levle"),
        ({"pass_config": {"pases": []}}, "pases"),
        ({"level": 7}, "CompilationConfig.level"),
        ({"compile_sizes": [4, -1]}, "CompilationConfig.compile_sizes"),
        ({"compile_sizes": [4, 4]}, "CompilationConfig.compile_sizes"),
        ({"cudagraph_capture_sizes": [1, 2, 2]}, "CompilationConfig.cudagraph_capture_sizes"),
        (
            {"max_num_tokens": 64, "cudagraph_capture_sizes": [1, 128]},
            "CompilationConfig.cudagraph_capture_sizes",
        ),
        ({"max_num_tokens": 64, "compile_sizes": [65]}, "CompilationConfig.compile_sizes"),
        ({"compile_ranges_endpoints": [64, 8]}, "CompilationConfig.compile_ranges_endpoints"),
        ({"cudagraph_mode": "SOMETIMES"}, "CompilationConfig.cudagraph_mode"),
        ({"mode": "JIT"}, "CompilationConfig.mode"),
        ({"compiler": ""}, "CompilationConfig.compiler"),
        ({"splitting_ops": ["attention"]}, "CompilationConfig.splitting_ops"),
        ({"pass_config": {"passes": ["a", "a"]}}, "PassConfig.passes"),
        ({"max_num_tokens": 0}, "CompilationConfig.max_num_tokens"),
    ],
)
def test_bad_values_name_the_field(data, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        CompilationConfig.from_dict(data)


def test_the_old_backend_key_names_its_new_name():
    renamed = r"CompilationConfig\.backend was renamed to CompilationConfig\.compiler"
    with pytest.raises(ValueError, match=renamed):
        CompilationConfig.from_dict({"backend": "eager"})


def test_levels_fill_only_unset_fields():
    o0 = CompilationConfig(level=0).resolve(
        max_num_tokens=256, level_passes=level_passes, has_cuda=False
    )
    assert o0.mode == CompilationMode.NONE and o0.cudagraph_mode == CUDAGraphMode.NONE
    assert o0.pass_config.passes == []
    o2 = CompilationConfig(level=2).resolve(
        max_num_tokens=256, level_passes=level_passes, has_cuda=True
    )
    assert o2.mode == CompilationMode.PIECEWISE
    assert o2.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert o2.cudagraph_capture_sizes == default_capture_sizes(256)
    assert o2.pass_config.passes == level_passes(2, "cuda")
    explicit = CompilationConfig(
        level=2,
        cudagraph_mode="PIECEWISE",
        compiler="eager",
        pass_config=PassConfig(passes=["noop_elimination"]),
    )
    r = explicit.resolve(max_num_tokens=256, level_passes=level_passes, has_cuda=True)
    assert r.cudagraph_mode == CUDAGraphMode.PIECEWISE and r.compiler == "eager"
    assert r.pass_config.passes == ["noop_elimination"]


def test_without_cuda_graph_modes_resolve_to_none():
    r = CompilationConfig(level=2).resolve(
        max_num_tokens=64, level_passes=level_passes, has_cuda=False
    )
    assert r.cudagraph_mode == CUDAGraphMode.NONE
    assert r.mode == CompilationMode.PIECEWISE  # compile still happens
    assert r.pass_config.passes == level_passes(2, "cpu")


def test_plus_and_minus_edits_adjust_the_level_list():
    pc = PassConfig(passes=["-pass_o1_cpu", "+fuse_add_rmsnorm"])
    r = CompilationConfig(level=1, pass_config=pc).resolve(
        max_num_tokens=64, level_passes=level_passes, has_cuda=False
    )
    assert r.pass_config.passes == ["fuse_add_rmsnorm"]
    exact = CompilationConfig(level=1, pass_config=PassConfig(passes=["fuse_add_rmsnorm"]))
    resolved = exact.resolve(max_num_tokens=64, level_passes=level_passes, has_cuda=False)
    assert resolved.pass_config.passes == ["fuse_add_rmsnorm"]


@pytest.mark.parametrize(
    "passes, message",
    [
        (["a", "+b"], "mixes exact names"),
        (["+a", "-a"], "both added"),
        (["+a", "+a"], "duplicate"),
        (["+"], "is not a pass name"),
        ("a", "expected a list"),
    ],
)
def test_a_bad_pass_list_is_one_error_naming_the_field(passes, message):
    with pytest.raises(ValueError, match=message) as e:
        PassConfig(passes=passes)
    assert "PassConfig.passes" in str(e.value)


def test_default_capture_sizes():
    assert default_capture_sizes(300) == [1, 2, 4] + list(range(8, 257, 8)) + [272, 288]
    assert default_capture_sizes(6) == [1, 2, 4]


def test_hash_ignores_paths_and_logging_but_not_compile_factors():
    base = CompilationConfig(level=2)
    same = base.replace(
        cache_dir="/elsewhere", debug_dump_path="/dump", progress_bar=False, use_cache=False
    )
    assert base.compute_hash() == same.compute_hash()
    assert base.compute_hash() != base.replace(compile_sizes=[1, 2]).compute_hash()
    assert (
        base.compute_hash()
        != base.replace(pass_config=PassConfig(passes=["noop_elimination"])).compute_hash()
    )
    assert base.compute_hash() != base.replace(inductor_config={"freezing": True}).compute_hash()


def test_hydra_schema_rejects_unknown_fields():
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError

    schema = OmegaConf.structured(CompilationConfig)
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(schema, {"levl": 2})


def test_the_default_level_is_one_constant_and_eager():
    from framework.core.config import DEFAULT_LEVEL

    r = CompilationConfig().resolve(max_num_tokens=64, level_passes=level_passes, has_cuda=False)
    assert r.level == DEFAULT_LEVEL == 0 and r.mode == CompilationMode.NONE
