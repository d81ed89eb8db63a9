"""Cache key factors: every factor moves the key, locations never do."""

import copy
import json
import sys
import types

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from framework.cache.key import (
    compute_cache_key,
    env_factors,
    flatten_factors,
    inductor_factors,
    source_factors,
    torch_settings_factors,
)
from framework.core.config import CompilationConfig


class _NamedPass(CustomGraphPass):
    def __init__(self, name):
        self.name = name

    def __call__(self, graph):
        return None

    def uuid(self):
        return self.name


def _key(**overrides):
    factors = {
        "compilation_config": "c0",
        "pass_manager": "p0",
        "model_config": "m0",
        "dtype": "float32",
        "quantization": None,
    }
    factors.update(overrides)
    return compute_cache_key(factors)[0]


def test_key_is_16_hex_and_independent_of_dict_order():
    key, normalized = compute_cache_key({"b": {"y": 1, "x": [1, 2]}, "a": "v"})
    assert len(key) == 16 and int(key, 16) >= 0
    assert compute_cache_key({"a": "v", "b": {"x": [1, 2], "y": 1}})[0] == key
    assert normalized == {"a": "v", "b": {"x": [1, 2], "y": 1}}


@pytest.mark.parametrize(
    "name,value",
    [
        ("compilation_config", "c1"),
        ("pass_manager", "p1"),
        ("model_config", "m1"),
        ("dtype", "bfloat16"),
        ("quantization", "fp8"),
        ("extra", 1),
    ],
)
def test_each_caller_factor_changes_the_key(name, value):
    assert _key(**{name: value}) != _key()


def test_torch_dtype_and_uuid_objects_are_portable():
    key_a, norm = compute_cache_key({"dtype": torch.bfloat16, "pm": _NamedPass("v1")})
    assert norm == {"dtype": "torch.bfloat16", "pm": {"uuid": "v1"}}
    assert compute_cache_key({"dtype": torch.bfloat16, "pm": _NamedPass("v2")})[0] != key_a


def test_factor_without_stable_repr_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="memory address.*uuid"):
        compute_cache_key({"thing": object()})


def test_env_factors_are_deterministic_and_track_versions_and_cpu(monkeypatch):
    env = env_factors()
    assert env["torch"] == torch.__version__
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env == env_factors()
    base = compute_cache_key({"env": env})[0]
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert compute_cache_key({"env": env_factors()})[0] != base
    monkeypatch.undo()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "NO AVX")
    assert compute_cache_key({"env": env_factors()})[0] != base


@pytest.mark.parametrize(
    "module,name,value",
    [
        (inductor_config, "freezing", True),
        (inductor_config, "max_autotune", True),
        (functorch_config, "donated_buffer", False),
    ],
)
def test_compiler_config_changes_the_key(module, name, value):
    # torch config modules must be changed through patch(): monkeypatch's undo deletes the
    # entry from the config module instead of restoring it.
    before = inductor_factors()
    with module.patch({name: value}):
        after = inductor_factors()
    assert compute_cache_key({"c": after})[0] != compute_cache_key({"c": before})[0]
    group = "inductor" if module is inductor_config else "functorch"
    assert after[group]["changed_from_default"][name] == value


def test_custom_post_grad_pass_enters_by_uuid():
    with inductor_config.patch(post_grad_custom_post_pass=_NamedPass("pm-1")):
        first = inductor_factors()
    assert first["custom_passes"]["post_grad_custom_post_pass"] == {"uuid": "pm-1"}
    with inductor_config.patch(post_grad_custom_post_pass=_NamedPass("pm-2")):
        assert compute_cache_key(inductor_factors())[0] != compute_cache_key(first)[0]


def test_compiler_config_paths_do_not_change_the_key(tmp_path):
    before = inductor_factors()
    with inductor_config.patch(
        {"global_cache_dir": str(tmp_path / "x"), "aot_inductor.output_path": str(tmp_path / "y")}
    ):
        assert inductor_factors() == before


def test_compilation_config_paths_do_not_change_its_hash():
    base = CompilationConfig()
    moved = base.replace(cache_dir="/somewhere/else", debug_dump_path="/tmp/dump")
    assert _key(compilation_config=moved.compute_hash()) == _key(
        compilation_config=base.compute_hash()
    )


def _checkout(root, body):
    pkg = root / "mymodels"
    pkg.mkdir(parents=True)
    (pkg / "llama.py").write_text(body)
    return str(pkg / "llama.py")


def test_source_factors_track_content_not_location(tmp_path, monkeypatch):
    file_a = _checkout(tmp_path / "checkout_a", "x = 1\n")
    file_b = _checkout(tmp_path / "elsewhere" / "checkout_b", "x = 1\n")
    monkeypatch.setattr(
        sys,
        "path",
        [str(tmp_path / "checkout_a"), str(tmp_path / "elsewhere" / "checkout_b")] + sys.path,
    )
    src_a, src_b = source_factors([file_a]), source_factors([file_b])
    assert list(src_a) == ["mymodels/llama.py"]
    assert src_a == src_b
    with open(file_b, "w") as f:
        f.write("x = 2\n")
    assert source_factors([file_b]) != src_a
    assert (
        compute_cache_key({"source": source_factors([file_b])})[0]
        != compute_cache_key({"source": src_a})[0]
    )


def test_source_factors_skip_pseudo_files(tmp_path):
    real = tmp_path / "m.py"
    real.write_text("pass\n")
    out = source_factors(
        ["<string>", "<eval_with_key>.3", str(tmp_path / "gone.py"), str(real), str(real)]
    )
    assert list(out.values()) == [source_factors([str(real)])["m.py"]]


def test_traced_torch_files_are_named_relative_to_site_packages():
    out = source_factors([torch.nn.modules.linear.__file__])
    assert list(out) == ["torch/nn/modules/linear.py"]


def test_standard_factors_are_json_and_flatten_with_dotted_names():
    factors = {"env": env_factors(), "inductor": inductor_factors()}
    key, normalized = compute_cache_key(factors)
    assert json.loads(json.dumps(normalized)) == normalized
    flat = flatten_factors(normalized)
    assert flat["env.torch"] == torch.__version__
    assert "inductor.inductor.hash" in flat
    changed = copy.deepcopy(normalized)
    changed["env"]["machine"] = "other"
    assert compute_cache_key(changed)[0] != key


def test_torch_settings_that_change_generated_code_change_the_key(monkeypatch):
    """The process-wide settings Inductor's own FX graph cache keys: the thread count its CPU
    kernels hard-code (``num_threads(N)``; GPU code keeps one key across counts), the default
    dtype, deterministic algorithms and the CUDA matmul precision."""
    base = torch_settings_factors(cpu_kernels=True)
    assert base == torch_settings_factors(cpu_kernels=True)
    assert base["cpu_threads"] == torch.get_num_threads()
    assert base["default_dtype"] == "torch.float32"
    key = compute_cache_key({"torch_settings": base})[0]

    def key_with(setting, value):
        monkeypatch.setattr(*setting, value)
        try:
            factors = torch_settings_factors(cpu_kernels=True)
            return compute_cache_key({"torch_settings": factors})[0]
        finally:
            monkeypatch.undo()

    threads = torch.get_num_threads()
    assert key_with((torch, "get_num_threads"), lambda: threads + 1) != key
    assert key_with((torch, "get_default_dtype"), lambda: torch.bfloat16) != key
    assert key_with((torch, "are_deterministic_algorithms_enabled"), lambda: True) != key
    tf32 = types.SimpleNamespace(
        fp32_precision="tf32",
        allow_fp16_reduced_precision_reduction=True,
        allow_bf16_reduced_precision_reduction=True,
    )
    assert key_with((torch.backends.cuda, "matmul"), tf32) != key
    gpu = torch_settings_factors(cpu_kernels=False)
    assert "cpu_threads" not in gpu
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    assert torch_settings_factors(cpu_kernels=False) == gpu
