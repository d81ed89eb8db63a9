"""Glue from a resolved :class:`CompilationConfig` to a compiled forward callable.

``build_forward`` returns the callable the runner invokes for each step, for every
compilation mode: eager (O0) or piecewise (trace once,
split, passes, per-range compile, artifact cache, warm start without Dynamo).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from framework.cache.key import source_factors
from framework.core.class_sources import class_source_files
from framework.core.config import CompilationConfig, CompilationMode

if TYPE_CHECKING:  # annotations only: the modules are imported when a piecewise build needs them
    from backends.piecewise.backend import PiecewiseBackend
    from framework.cache.store import ArtifactStore
    from framework.compile.trace_once import TraceOnce
    from passes.manager import PassManager

logger = logging.getLogger(__name__)


def model_source_files(model: torch.nn.Module) -> list[str]:
    """Source files of every module class in the model (what Dynamo will trace)."""
    return class_source_files(type(m) for m in model.modules())


@dataclass
class CompiledForward:
    """The step callable plus what it took to build it."""

    forward: Callable[..., Any]
    """The model's forward (eager) or a :class:`TraceOnce`."""
    mode: CompilationMode
    stats: dict[str, Union[float, bool]] = field(default_factory=dict)
    """``warm_restore_s`` and ``dynamo_skipped`` when the program was restored from the cache."""
    backend: Optional[PiecewiseBackend] = None
    pass_manager: Optional[PassManager] = None
    trace_once: Optional[TraceOnce] = None
    store: Optional[ArtifactStore] = None
    finalize: Optional[Callable[[], None]] = None
    """Run after the first (tracing) forward: saves the program for warm starts."""


def build_pass_manager(
    config: CompilationConfig, dtype: torch.dtype, quant_hash: Optional[str]
) -> Optional[PassManager]:
    if not config.pass_config.passes:
        return None
    from passes.manager import PassManager

    manager = PassManager(
        config.pass_config,
        dtype=dtype,
        quant_config_hash=quant_hash,
        debug_dump_path=config.debug_dump_path,
    )
    # The resolved config records the order the passes run in (the manager sorts the list
    # into the canonical order; config.py, a leaf module, cannot import the registry).
    config.pass_config.passes = list(manager.names)
    return manager


def build_forward(
    model: torch.nn.Module,
    config: CompilationConfig,
    *,
    model_hash: str,
    dtype: torch.dtype,
    quant_hash: Optional[str],
    model_tag: str = "model",
    wrap_piece: Optional[Callable] = None,
    speculative_hash: Optional[str] = None,
) -> CompiledForward:
    """``speculative_hash``: the speculative config's hash (its method, k and draft change the
    compiled sizes), a cache-key factor when speculation is on."""
    if config.mode == CompilationMode.NONE:
        return CompiledForward(model, config.mode)
    return _build_piecewise(
        model,
        config,
        model_hash=model_hash,
        dtype=dtype,
        quant_hash=quant_hash,
        model_tag=model_tag,
        wrap_piece=wrap_piece,
        speculative_hash=speculative_hash,
    )


def _build_piecewise(
    model,
    config: CompilationConfig,
    *,
    model_hash,
    dtype,
    quant_hash,
    model_tag,
    wrap_piece,
    speculative_hash=None,
) -> CompiledForward:
    from backends.piecewise.backend import PiecewiseBackend
    from backends.piecewise.compiler import make_compiler
    from framework.compile.trace_once import ArgBinding, TraceOnce

    passes = build_pass_manager(config, dtype, quant_hash)
    compiler = make_compiler(
        config.compiler, graph_pass=passes, inductor_config=config.inductor_config
    )
    store = None
    if config.use_cache and compiler.produces_artifacts:
        store = _open_store(
            model,
            config,
            compiler,
            passes,
            model_hash=model_hash,
            dtype=dtype,
            quant_hash=quant_hash,
            model_tag=model_tag,
            speculative_hash=speculative_hash,
        )
    backend = PiecewiseBackend(
        compiler=compiler,
        splitting_ops=config.splitting_ops,
        compile_ranges_endpoints=config.compile_ranges_endpoints,
        compile_sizes=config.compile_sizes,
        max_num_tokens=config.max_num_tokens,
        store=store,
        graph_pass=passes,
        progress=config.progress_bar,
        dump_path=config.debug_dump_path,
        wrap_piece=wrap_piece,
    )
    out = CompiledForward(None, config.mode, backend=backend, pass_manager=passes, store=store)
    traced = TraceOnce(model, backend, dump_path=config.debug_dump_path)
    out.trace_once = traced
    t0 = time.perf_counter()
    restored = backend.restore()
    if restored is not None:
        split, program = restored
        if program.get("source_hashes") == source_factors(program.get("source_files", [])):
            traced.install(split, ArgBinding.from_json(program["binding"]))
            out.stats["warm_restore_s"] = time.perf_counter() - t0
            out.stats["dynamo_skipped"] = True
        else:
            logger.info("model source changed since the cached program; re-tracing")
            if passes is not None:
                passes.instances.clear()  # the restored pieces are not used

    def finalize() -> None:
        if passes is not None:
            # Every piece is compiled now: name each fusion that matched nothing.
            out.stats["unmatched_fusions"] = passes.warn_unmatched()
            verified = passes.verify_summary()
            if verified is not None:
                logger.warning(verified)  # one line, shown by default: the check passed
        if traced.binding is None or out.stats.get("dynamo_skipped"):
            return
        # The key covers the model's class files; the files Dynamo actually traced through
        # (helpers in other modules) are checked again when the program is restored.
        files = backend.traced_files
        backend.save_program(
            {
                "binding": traced.binding.to_json(),
                "source_files": files,
                "source_hashes": source_factors(files),
            }
        )
        if config.debug_dump_path:
            Path(config.debug_dump_path).mkdir(parents=True, exist_ok=True)
            (Path(config.debug_dump_path) / "binding.json").write_text(
                json.dumps(traced.binding.to_json(), indent=1)
            )

    out.finalize = finalize
    out.forward = traced
    return out


def _runs_on_cpu(model: torch.nn.Module) -> bool:
    """Whether Inductor writes C++ kernels for the model: its weights are not on a GPU (on the
    CPU, or not placed yet)."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device.type not in ("cuda", "xpu")
    return True


def _open_store(
    model,
    config,
    compiler,
    passes,
    *,
    model_hash,
    dtype,
    quant_hash,
    model_tag,
    speculative_hash=None,
):
    from framework.cache.factor_memo import inductor_side_factors
    from framework.cache.key import env_factors, torch_settings_factors, tp_factors
    from framework.cache.store import ArtifactStore, default_cache_dir

    root = config.cache_dir or default_cache_dir()
    # Memoized under the cache root: computing them imports Inductor (and Dynamo).
    side = inductor_side_factors(root)
    factors = {
        "env": env_factors(cpp_compiler=side["cpp_compiler"]),
        "torch_settings": torch_settings_factors(cpu_kernels=_runs_on_cpu(model)),
        "compiler": side["inductor"] if compiler.name == "inductor" else {},
        "compiler_adaptor": compiler.compute_hash(),
        "compilation_config": config.compute_hash(),
        "passes": passes.cache_factors() if passes is not None else None,
        "model_config": model_hash,
        "dtype": str(dtype),
        "quantization": quant_hash,
        "source": source_factors(model_source_files(model)),
        "tensor_parallel": tp_factors(),
    }
    if speculative_hash is not None:  # absent when off: the keys of engines without it stay
        factors["speculative"] = speculative_hash
    return ArtifactStore.open(root, factors, rank=tp_factors()["rank"], model_tag=model_tag)
