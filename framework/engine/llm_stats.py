"""What ``llm.stats`` reports, typed and per instance: what one ``LLM``'s construction took, its
step times, its compiled pieces and its memory.

Each ``LLM`` owns its own :class:`StartupStats`; capture counts come from the engine's own
CUDA-graph wrappers (:meth:`framework.cudagraph.graph_setup.GraphSetup.stats`), never from a
process-wide sum, so a second engine in one process reports its own captures.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from framework.compile.build import CompiledForward


@dataclass
class StartupStats:
    load_s: float = 0.0
    """Construction up to the warm-up forward: weights, KV cache, graph set-up, and on a warm
    start the artifact restore (``warm_restore_s`` in the stats is part of it)."""
    compile_s: Optional[float] = None
    """The warm-up forward that traces/compiles (None at level 0: nothing compiles)."""
    captures: int = 0
    """CUDA graphs this engine captured at start-up."""
    capture_time_s: float = 0.0
    startup_s: float = 0.0
    """The whole construction."""
    weight_check_s: float = 0.0
    """Part of ``load_s``: the one pass over each weight that looks for NaN/inf."""
    weights_load_s: float = 0.0
    """Part of ``load_s``: loading, quantizing and re-laying the weights, or mapping them
    from the processed-weights cache."""
    weights_cache: str = "off"
    """The processed-weights cache: ``hit`` (mapped), ``written`` (computed and saved),
    ``miss`` (computed, not saved), ``corrupt`` (a bad file dropped), ``uncacheable``, ``off``."""
    weights_page_cache_frac: Optional[float] = None
    """On a ``hit``: the fraction of the mapped file the page cache held at start.  Below 1,
    the warm-up forward (``compile_s``) reads the rest from disk."""

    def as_dict(self) -> dict[str, Any]:
        """The keys ``LLM.stats`` has always reported (``compile_s`` only when it ran)."""
        out: dict[str, Any] = {"load_s": self.load_s}
        if self.compile_s is not None:
            out["compile_s"] = self.compile_s
        out["captures"] = self.captures
        out["capture_time_s"] = self.capture_time_s
        out["startup_s"] = self.startup_s
        out["weight_check_s"] = self.weight_check_s
        out["weights_load_s"] = self.weights_load_s
        out["weights_cache"] = self.weights_cache
        if self.weights_page_cache_frac is not None:
            out["weights_page_cache_frac"] = self.weights_page_cache_frac
        return out


def step_time_stats(step_times: dict[str, list[float]]) -> dict[str, float]:
    """``{kind}_steps``, ``{kind}_ms_median`` and ``{kind}_ms_p90`` per step kind that ran."""
    out: dict[str, float] = {}
    for kind, times in step_times.items():
        if times:
            ms = sorted(t * 1e3 for t in times)
            out[f"{kind}_steps"] = len(ms)
            out[f"{kind}_ms_median"] = statistics.median(ms)
            out[f"{kind}_ms_p90"] = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return out


def compile_stats(c: "CompiledForward") -> dict[str, Any]:
    """What building the compiled forward (a ``CompiledForward``) took: Dynamo, the
    backend's compiles and loads, the artifact cache, the passes."""
    out: dict[str, Any] = {}
    if c.trace_once is not None:
        out["dynamo_time_s"] = c.trace_once.dynamo_time_s
        out["dynamo_traces"] = c.trace_once.num_traces
    if c.backend is not None:
        out.update({f"compile_{k}": v for k, v in c.backend.stats.as_dict().items()})
    if c.store is not None:
        out.update({f"cache_{k}": v for k, v in c.store.stats.as_dict().items()})
        out["cache_dir"] = str(c.store.dir)
    if c.pass_manager is not None:
        out["passes"] = c.pass_manager.stats()
    out.update(c.stats)
    return out


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a shared or tied tensor counts once).
    Tensors that are views into one larger storage (weights mapped from one file) count the
    bytes they span, not the whole storage each."""
    spans: dict[tuple[str, int], tuple[int, list]] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        _, parts = spans.setdefault((str(t.device), s.data_ptr()), (s.nbytes(), []))
        if t.is_contiguous():
            parts.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        else:
            parts.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
    total = 0
    for nbytes, parts in spans.values():
        covered, end = 0, None
        for begin, stop in sorted(parts):
            if end is None or begin >= end:
                covered += stop - begin
                end = stop
            elif stop > end:
                covered += stop - end
                end = stop
        total += min(nbytes, covered)
    return total


def process_memory() -> dict[str, int]:
    """This process's resident memory now and at its peak (Linux ``/proc/self/status``;
    empty elsewhere)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss_bytes" if key == "VmRSS" else "rss_peak_bytes"] = (
                        int(value.split()[0]) * 1024
                    )
    except OSError:
        pass
    return out


def memory_stats(
    model: torch.nn.Module, kv_caches: dict[str, torch.Tensor], packed_layers: list[str]
) -> dict[str, int]:
    """What the engine holds, counted from the tensors themselves: ``weights_bytes`` (every
    parameter and buffer of the model, each storage once; packed weights are the model's own
    tensors, so they are in it, and nothing is held beside it), ``packed_weight_bytes`` (the
    part of it that is re-laid out for a kernel), ``kv_cache_bytes``, and the process's
    resident memory (``rss_bytes``, ``rss_peak_bytes``)."""
    tensors = list(model.parameters()) + list(model.buffers())
    from framework.engine.model_prep import relaid_parameters

    packed = [
        t for name in packed_layers for t in relaid_parameters(model.get_submodule(name)).values()
    ]
    out = {
        "weights_bytes": _storage_bytes(tensors),
        "packed_weight_bytes": _storage_bytes(packed),
        "kv_cache_bytes": _storage_bytes(kv_caches.values()),
    }
    out.update(process_memory())
    return out
