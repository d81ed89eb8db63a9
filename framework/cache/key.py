"""Cache-key factors for the on-disk artifact cache.

A cache key is the hash of a dict of *named factors*.  Keeping the factors (not just the hash)
lets ``python -m framework.cache explain`` say *which* factor made two keys differ — the usual
question when a warm start unexpectedly recompiles, or worse, when a stale artifact is loaded
because a factor was missing.

Standard factor groups (the backend adds its own entries next to them)::

    factors = {
        "env": env_factors(),                 # torch/python/platform/CPU ISA/GPU/compiler
        "inductor": inductor_factors(),       # Inductor + functorch config (hash + values)
        "source": source_factors(files),      # sha256 of every file Dynamo traced
        "compilation_config": cfg.compute_hash(),   # already excludes paths (NO_HASH)
        "pass_manager": pm.uuid(), "model_config": ..., "dtype": "bfloat16", "quant": ...,
    }
    key, factors = compute_cache_key(factors)

Nothing here depends on *where* things live on disk: config paths are dropped, and traced files
are named relative to their ``sys.path`` root, so a moved checkout or venv keeps its key.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

from framework.compat import inductor as compat_inductor
from framework.core.parallel_state import get_tp_state

KEY_LENGTH = 16

# Config entries whose *name* says they hold a filesystem location (last dotted component):
# ``global_cache_dir``, ``aot_inductor.output_path``, ``torchinductor_worker_logpath`` ...
_PATH_NAME = re.compile(r"(^|_)(dir|path|logpath)$")

# Inductor hooks that may hold pass objects; torch keys them by ``uuid()`` (CustomGraphPass).
_CUSTOM_PASS_HOOKS = (
    "post_grad_custom_pre_pass",
    "post_grad_custom_post_pass",
    "joint_custom_pre_pass",
    "joint_custom_post_pass",
    "pre_grad_custom_pass",
    "_pre_fusion_custom_pass",
)


def _sha256(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> str:
    """Stable JSON: sorted keys, no whitespace variance, non-JSON values made portable."""
    return json.dumps(_portable(obj), sort_keys=True, separators=(",", ":"))


def compute_cache_key(factors: Mapping[str, Any]) -> tuple[str, dict]:
    """Hash named factors into a 16-hex-char key.

    Returns ``(key, normalized_factors)``; the normalized dict is exactly what was hashed (plain
    JSON data) and is what :class:`framework.cache.store.ArtifactStore` writes to ``factors.json``.
    """
    if not isinstance(factors, Mapping):
        raise TypeError(
            f"compute_cache_key: factors must be a mapping of name -> value, "
            f"got {type(factors).__name__}"
        )
    normalized = json.loads(canonical_json(dict(factors)))
    key = _sha256(canonical_json(normalized))[:KEY_LENGTH]
    return key, normalized


def _portable(value: Any) -> Any:
    """Turn a factor value into plain JSON data that is stable across processes.

    Objects with ``uuid()`` (CustomGraphPass, pass managers) are represented by it; functions by
    their qualified name plus a hash of their source; anything else must be plain data or have a
    deterministic ``repr`` (enums, dtypes) — a repr containing a memory address is rejected
    because it would give a fresh key in every process.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_portable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_portable(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, bytes):
        return "sha256:" + _sha256(value)
    if isinstance(value, Path):
        return str(value)
    uuid = getattr(value, "uuid", None)
    if callable(uuid):
        return {"uuid": _portable(uuid())}
    if inspect.isfunction(value) or inspect.ismethod(value) or inspect.isclass(value):
        return _callable_identity(value)
    text = repr(value)
    if re.search(r" at 0x[0-9a-fA-F]+", text):
        raise ValueError(
            f"cache key factor value {text} has no stable representation (its repr contains a "
            f"memory address); give it a uuid() method or pass a hash string instead"
        )
    return text


def _callable_identity(fn: Any) -> dict:
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    try:
        source_hash = _sha256(inspect.getsource(fn))[:KEY_LENGTH]
    except (OSError, TypeError):
        source_hash = None  # builtins / C functions: the name (plus torch version) identifies it
    return {"callable": name, "source": source_hash}


# ----------------------------------------------------------------------------- environment
@functools.lru_cache(maxsize=1)
def _cpp_compiler_identity() -> dict[str, str]:
    """Inductor's C++ compiler and its version line (CPU codegen builds with it)."""
    try:
        compiler, info = compat_inductor.cpp_compiler_identity()
    except Exception as e:  # no compiler installed: Inductor CPU would fail anyway
        return {"compiler": "unavailable", "error": type(e).__name__}
    match = re.search(r"(?:gcc|clang|icx|icpx)[^_]*? version [^_]+", info)
    version = match.group(0).strip() if match else info[-120:].strip("_ ")
    return {
        "compiler": os.path.basename(str(compiler)),
        "version": version,
        "version_info_sha256": _sha256(info)[:KEY_LENGTH],
    }


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def env_factors(cpp_compiler: dict[str, str] | None = None) -> dict[str, Any]:
    """Software and hardware that change generated code: versions, CPU ISA, GPU, C++ compiler.

    ``cpp_compiler``: the compiler identity when already known (``factor_memo``); computing it
    imports Inductor.

    The CPU ISA comes from ATen's cpuinfo probes, not Inductor's ``pick_vec_isa()``: that one
    compiles test programs (~1 s per process) and is determined by these flags plus the compiler.
    """
    import torch

    cpu = torch.cpu
    isa_flags = {}
    for flag in ("avx2", "avx512", "avx512_bf16", "vnni", "amx_tile", "amx_fp16"):
        probe = getattr(cpu, f"_is_{flag}_supported", None)
        if probe is not None:
            isa_flags[flag] = bool(probe())
    factors: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "triton": _package_version("triton"),
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "system": platform.system(),
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_isa_flags": isa_flags,
        "cpp_compiler": cpp_compiler if cpp_compiler is not None else _cpp_compiler_identity(),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
    }
    if torch.cuda.is_available():
        devices = []
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            devices.append(
                {"name": torch.cuda.get_device_name(i), "capability": f"{major}.{minor}"}
            )
        # One entry per distinct device kind: the number of GPUs does not change the code.
        factors["gpus"] = sorted({json.dumps(d, sort_keys=True) for d in devices})
    return factors


def torch_settings_factors(*, cpu_kernels: bool) -> dict[str, Any]:
    """Process-wide torch settings that change the code Inductor generates: the ones torch
    2.13's own FX graph cache keys (``FxGraphHashDetails``), which this cache sits in front of.

    * ``cpu_threads`` (``cpu_kernels``: the code is Inductor's C++ for the CPU): the kernels
      are written for the compiling process's thread count (``#pragma omp parallel
      num_threads(N)``, N = ``torch.get_num_threads()`` with ``cpp.threads`` left at -1), so
      an artifact compiled at one count would run at it wherever it is loaded: serial kernels
      in a 2-thread engine, or 2 threads where the user asked for 1.  Kept where
      ``cpp.threads`` is fixed too (a needless miss, never a stale load).
    * ``default_dtype``: factory ops without a dtype are lowered with it.
    * ``deterministic``: deterministic algorithms change lowerings.
    * ``cuda_matmul``: TF32 and reduced-precision reductions change matmul code on GPUs.

    A setting this torch lacks is ``None``."""
    import torch

    cuda_matmul = torch.backends.cuda.matmul
    out: dict[str, Any] = {
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": [
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            getattr(torch.utils.deterministic, "fill_uninitialized_memory", None),
        ],
        "cuda_matmul": [
            getattr(cuda_matmul, name, None)
            for name in (
                "fp32_precision",
                "allow_fp16_reduced_precision_reduction",
                "allow_bf16_reduced_precision_reduction",
            )
        ],
    }
    if cpu_kernels:
        out["cpu_threads"] = torch.get_num_threads()
    return out


# ----------------------------------------------------------------------------- compiler config
def _config_module_factors(module: Any) -> dict[str, Any]:
    try:
        config = module.save_config_portable()
    except AttributeError:  # older torch: fall back to the public attributes
        config = {
            k: v
            for k, v in vars(module).items()
            if not k.startswith("_") and not inspect.ismodule(v)
        }
    out = {}
    for name, value in config.items():
        if _PATH_NAME.search(name.rsplit(".", 1)[-1]):
            continue  # where files go does not change what is compiled
        if isinstance(value, str) and os.path.isabs(value):
            continue
        out[name] = _portable(value)
    return out


def custom_pass_identity(obj: Any) -> Any:
    """How a pass object set on an Inductor hook enters the key: ``uuid()`` when it has one."""
    if obj is None:
        return None
    return _portable(obj)


def inductor_factors() -> dict[str, Any]:
    """Inductor and functorch (AOTAutograd) config, minus paths, plus custom-pass uuids.

    Each group is reduced to a hash (the full dump has ~600 entries) next to the values that
    differ from torch's defaults, so ``explain`` can still name the changed setting.
    """
    functorch_config = compat_inductor.functorch_config()
    inductor_config = compat_inductor.inductor_config()

    out: dict[str, Any] = {}
    for group, module in (("inductor", inductor_config), ("functorch", functorch_config)):
        values = _config_module_factors(module)
        defaults = _defaults_of(module)
        changed = {k: v for k, v in values.items() if k in defaults and defaults[k] != v}
        out[group] = {
            "hash": _sha256(canonical_json(values))[:KEY_LENGTH],
            "changed_from_default": changed,
        }
    out["custom_passes"] = {
        name: custom_pass_identity(getattr(inductor_config, name, None))
        for name in _CUSTOM_PASS_HOOKS
        if hasattr(inductor_config, name)
    }
    return out


def _defaults_of(module: Any) -> dict[str, Any]:
    """Portable default values of a torch config module (for the readable "changed" list)."""
    entries = getattr(module, "_config", None)
    if not isinstance(entries, dict):
        return {}
    out = {}
    for name, entry in entries.items():
        default = getattr(entry, "default", None)
        try:
            out[name] = _portable(default)
        except ValueError:
            continue
    return out


# ----------------------------------------------------------------------------- traced source
def _portable_file_name(path: str) -> str:
    """Name a file by its path under the longest matching ``sys.path`` root (else basename).

    ``/home/a/piecewise/models/llama.py`` -> ``models/llama.py``, and
    ``.../site-packages/torch/nn/modules/linear.py`` -> ``torch/nn/modules/linear.py``.
    """
    resolved = os.path.realpath(path)
    best = None
    for root in sys.path:
        if not root:
            root = os.getcwd()
        root = os.path.realpath(root)
        if resolved.startswith(root.rstrip(os.sep) + os.sep):
            if best is None or len(root) > len(best):
                best = root
    if best is None:
        return os.path.basename(resolved)
    return os.path.relpath(resolved, best).replace(os.sep, "/")


def source_factors(files: Iterable[str]) -> dict[str, str]:
    """sha256 (16 hex) of each traced file's contents, keyed by its location-independent name.

    Pseudo-files Dynamo reports (``<string>``, ``<eval_with_key>.3``) and files that no longer
    exist are skipped: they have no source on disk to go stale.
    """
    out: dict[str, str] = {}
    for path in sorted(set(map(str, files))):
        if path.startswith("<") or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            digest = _sha256(f.read())[:KEY_LENGTH]
        name = _portable_file_name(path)
        if name in out and out[name] != digest:
            # Two different files map to one name (same relative path under two roots).
            name = f"{name}#{digest}"
        out[name] = digest
    return out


def tp_factors() -> dict[str, Any]:
    """Tensor parallelism: each rank compiles its own shard (other shapes, its collectives'
    group), so world size, rank and group name are part of the key."""
    st = get_tp_state()
    return {"world_size": st.world_size, "rank": st.rank, "group": st.group_name}


def flatten_factors(factors: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts flattened with dotted names (for ``explain``)."""
    out: dict[str, Any] = {}
    for name, value in factors.items():
        dotted = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, Mapping) and value:
            out.update(flatten_factors(value, dotted))
        else:
            out[dotted] = value
    return out
