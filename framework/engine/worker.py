"""One rank's model and everything that runs it: weights (its shard), KV cache, the compiled
forward, CUDA graphs and the model runner.

A :class:`Worker` is what an executor drives (``framework.engine.executor``): in-process for
one rank, and one per process for tensor parallelism (rank 0 in the engine's process, the
other ranks in worker processes running :func:`framework.engine.executor.worker_loop`).  It
knows nothing of requests beyond the chunks of one step; the engine core schedules.

The worker owns its tensor-parallel state: it builds, compiles and runs its model inside
``with tp_state(self.tp):`` (``framework.core.parallel_state``), so another engine in the
process, or another thread, never sees it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Protocol

import torch

from backends.attention.selector import default_backend
from backends.piecewise.forward_replay import ForwardReplay
from framework.compile.build import CompiledForward, build_forward
from framework.core.config import (
    DEFAULT_LEVEL,
    CompilationConfig,
    CompilationMode,
    round_sizes_to_query_len,
)
from framework.core.forward_context import BatchDescriptor, CUDAGraphMode
from framework.core.parallel_state import TPState, kv_head_layout, tp_state
from framework.cudagraph.emulation import EmulatedGraphOps
from framework.cudagraph.graph_setup import setup_graphs
from framework.engine.block_manager import BlockManager
from framework.engine.capture import capture_graphs, dummy_batch, split_tokens
from framework.engine.cpu_env import warn_cpu_settings
from framework.engine.kv_cache import KVCacheSpec, allocate_kv_caches, num_blocks_for
from framework.engine.llm_stats import StartupStats
from framework.engine.model_prep import prepare_model
from framework.engine.request import ScheduledChunk
from framework.engine.runner import ModelRunner
from framework.engine.spec.config import SpeculativeConfig, speculative_config_of
from models.config import parse_dtype
from passes.quant_schemes import calibrate_activation_scales
from passes.registry import level_passes

logger = logging.getLogger(__name__)


class RankGroup(Protocol):
    """What a worker needs of its tensor-parallel group (``framework.engine.parallel``)."""

    rank: int
    world_size: int
    device: Optional[str]

    @property
    def state(self) -> TPState: ...

    def handshake(self) -> None: ...

    def startup_fail_hook(self) -> None: ...

    def rank_path(self, path: str) -> str: ...


def _no_sample(logits, reqs):
    """A rank other than 0 samples nothing: rank 0 samples from the all-gathered logits."""
    return [0] * len(reqs), None


def _no_verify(logits, reqs, drafts, draft_probs=None, argmax=None):
    """A rank other than 0 verifies nothing: rank 0 does, from the all-gathered logits."""
    return [[0] for _ in reqs]


class Worker:
    """Build one rank's model, compile it, warm it up and capture its graphs (the ``LLM``
    arguments, less the engine's own); then :meth:`execute` runs steps."""

    def __init__(
        self,
        model: str,
        dtype: str | torch.dtype = "float32",
        optimization_level: Optional[int] = None,
        compilation_config: Optional[CompilationConfig | dict] = None,
        quantization: Any = None,
        max_num_seqs: int = 8,
        max_model_len: int = 512,
        cache_dir: Optional[str] = None,
        seed: int = 0,
        *,
        max_num_batched_tokens: Optional[int] = None,
        block_size: int = 16,
        attention_backend: Optional[str] = None,
        kv_cache_memory_bytes: Optional[int] = None,
        device: Optional[str] = None,
        model_tag: Optional[str] = None,
        enable_prefix_caching: bool = False,
        emulate_cuda_graphs: bool = False,
        strict_weights: bool = False,
        speculative_config: Any = None,
        group: Optional[RankGroup] = None,
        t_start: Optional[float] = None,
    ):
        t_start = time.perf_counter() if t_start is None else t_start
        self.group = group
        self.spec_config: Optional[SpeculativeConfig] = speculative_config_of(speculative_config)
        self.uniform_query_len = self.spec_config.query_len if self.spec_config else 1
        """Query tokens per request of a uniform batch: 1, or 1 + k (verify steps)."""
        self.spec_size_warning: Optional[str] = None
        """Why the compile / capture sizes cannot cover a full verify batch (None: they do)."""
        self.tp: TPState = group.state if group is not None else TPState()
        self.rank = self.tp.rank
        self.device = torch.device((group.device if group is not None else None) or device or "cpu")
        if self.device.type == "cpu":
            warn_cpu_settings()
        self.max_model_len = max_model_len
        self.startup = StartupStats()
        """Typed timings and counts of construction (per instance)."""
        with tp_state(self.tp):
            quant_hash = self._load(
                model,
                dtype,
                quantization,
                compilation_config,
                optimization_level=optimization_level,
                cache_dir=cache_dir,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                block_size=block_size,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                enable_prefix_caching=enable_prefix_caching,
                has_graphs=self.device.type == "cuda" or emulate_cuda_graphs,
                strict_weights=strict_weights,
                model_tag=model_tag,
            )
            self._compile(
                quant_hash,
                attention_backend=attention_backend or default_backend(self.device),
                max_num_seqs=max_num_seqs,
                model_tag=model_tag,
                graph_ops=EmulatedGraphOps() if emulate_cuda_graphs else None,
                seed=seed,
                t_start=t_start,
            )
            self._capture()

    # ------------------------------------------------------------------ setup
    def _load(
        self,
        model: str,
        dtype,
        quantization: Any,
        compilation_config,
        *,
        optimization_level: Optional[int],
        cache_dir: Optional[str],
        max_num_seqs: int,
        max_num_batched_tokens: Optional[int],
        block_size: int,
        kv_cache_memory_bytes: Optional[int],
        enable_prefix_caching: bool,
        has_graphs: bool,
        strict_weights: bool = False,
        model_tag: Optional[str] = None,
    ) -> Optional[str]:
        """Step 1: weights (and quantization), the resolved config, the KV cache and the
        block manager.  Returns the quantization hash.  ``strict_weights``: a checkpoint
        tensor holding NaN or inf is an error, not a warning."""
        self.dtype = parse_dtype(dtype)
        cc = compilation_config or CompilationConfig()
        if isinstance(cc, dict):
            cc = CompilationConfig.from_dict(cc)
        if cc.level is None:
            level = DEFAULT_LEVEL if optimization_level is None else optimization_level
            cc = cc.replace(level=level)
        if cache_dir is not None:
            cc = cc.replace(cache_dir=cache_dir)
        max_num_tokens = max_num_batched_tokens or cc.max_num_tokens or self.max_model_len
        # Graph modes resolve as on a GPU when graphs can run: CUDA, or emulated graphs.
        self.config = cc.resolve(
            max_num_tokens=max_num_tokens, level_passes=level_passes, has_cuda=has_graphs
        )
        if self.uniform_query_len > 1:
            # Verify steps run 1 + k tokens per request: sizes are multiples of it.
            self.config, self.spec_size_warning = round_sizes_to_query_len(
                self.config, self.uniform_query_len, max_num_seqs
            )
            if self.spec_size_warning is not None and self.rank == 0:
                logger.warning("!!! %s", self.spec_size_warning)
        if self.group is not None and self.config.debug_dump_path:
            # Each rank dumps into its own folder: the ranks' graphs differ (shards, slices).
            dump = self.group.rank_path(self.config.debug_dump_path)
            self.config = self.config.replace(debug_dump_path=dump)
        prepared = prepare_model(
            model,
            self.dtype,
            self.device,
            quantization,
            self.config,
            strict=strict_weights,
            model_tag=model_tag or "model",
        )
        self.model, self.model_config = prepared.model, prepared.model_config
        self.packed_layers = prepared.packed_layers
        self.startup.weight_check_s = self.model.weight_check.check_s
        self.startup.weights_load_s = prepared.load_s
        self.startup.weights_cache = prepared.weights_cache
        self.startup.weights_page_cache_frac = prepared.page_cache_frac
        self.weights_path = prepared.weights_path
        """The processed-weights file the model's tensors are mapped from (or were saved to)."""
        self.quant_config, quant_hash, self.quantized_layers = prepared.quantized

        mc = self.model_config
        kv_heads = kv_head_layout(mc.num_kv_heads, self.tp.world_size)[0]  # this rank's heads
        spec = KVCacheSpec(mc.num_layers, kv_heads, mc.head_dim, self.dtype, block_size)
        num_blocks = num_blocks_for(
            spec,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            memory_bytes=kv_cache_memory_bytes,
        )
        layer_names = self.model.attention_layer_names()
        self.kv_caches = allocate_kv_caches(spec, layer_names, num_blocks, self.device)
        self.block_size = block_size
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        """The KV blocks: the engine core's scheduler allocates from it (rank 0); dummy
        batches at start-up use it on every rank."""
        return quant_hash

    def _forward_replay(self) -> Optional[ForwardReplay]:
        """The runner's forward replayed whole on CPU (``cpu_replay_forward``), where pieces
        replay at all: a CPU device, a piecewise-compiled model, ``cpu_replay_max_tokens``, and
        no (emulated) CUDA graphs around the forward."""
        cfg = self.config
        backend = self.compiled.backend
        if (
            self.device.type != "cpu"
            or self.graphs.mode != CUDAGraphMode.NONE
            or backend is None
            or not cfg.cpu_replay_forward
            or cfg.cpu_replay_max_tokens <= 0
        ):
            return None
        state = [*self.model.parameters(), *self.model.buffers()]
        return ForwardReplay(self.runner.forward, backend, state)

    def _compile(
        self,
        quant_hash: Optional[str],
        *,
        attention_backend: str,
        max_num_seqs: int,
        model_tag: Optional[str],
        graph_ops: Any,
        seed: int,
        t_start: float,
    ) -> None:
        """Step 2: the CUDA-graph set-up, the compiled forward (trace + compile, or a warm
        restore), the runner, static-quantization calibration and the warm-up forward that
        compiles (and saves the program for warm starts)."""
        mc = self.model_config
        self.graphs = setup_graphs(
            self.config,
            attention_backend=attention_backend,
            max_num_seqs=max_num_seqs,
            graph_ops=graph_ops,
            uniform_decode_query_len=self.uniform_query_len,
        )
        self.compiled: CompiledForward = build_forward(
            self.model,
            self.config,
            model_hash=mc.compute_hash(),
            dtype=self.dtype,
            quant_hash=quant_hash,
            model_tag=model_tag or _model_tag(mc),
            wrap_piece=self.graphs.wrap_piece(),
            speculative_hash=self.spec_config.compute_hash() if self.spec_config else None,
        )
        self.runner = ModelRunner(
            self.model,
            self.graphs.wrap_forward(self.compiled.forward),
            kv_caches=self.kv_caches,
            block_size=self.block_size,
            max_num_seqs=max_num_seqs,
            max_num_tokens=self.config.max_num_tokens,
            max_model_len=self.max_model_len,
            device=self.device,
            attention_backend=attention_backend,
            dispatch=self.graphs.dispatcher.dispatch,
            sampler=None if self.rank == 0 else _no_sample,
            uniform_query_len=self.uniform_query_len,
            verify=None if self.rank == 0 else _no_verify,
        )
        self.runner.cpu_replay_max_tokens = self.config.cpu_replay_max_tokens
        self.forward_replay = self._forward_replay()
        if self.forward_replay is not None:
            self.runner.forward = self.forward_replay
        if self.group is not None:
            self.group.handshake()
            self.group.startup_fail_hook()  # test hook: PIECEWISE_TP_FAIL=<rank>:startup
        self.startup.load_s = time.perf_counter() - t_start
        if self.quant_config is not None:
            self._calibrate(seed)
        if self.config.mode != CompilationMode.NONE:
            t0 = time.perf_counter()
            # Cold: the forward that traces (16 tokens, so no size is specialised).  Warm (the
            # program restored, nothing to trace): one token, which still touches every weight
            # once, so the first request pays no page faults.
            warm = bool(self.compiled.stats.get("dynamo_skipped"))
            self.dummy_run(1 if warm else min(self.config.max_num_tokens, 16))
            if self.compiled.finalize is not None:
                self.compiled.finalize()
            self.startup.compile_s = time.perf_counter() - t0

    def _capture(self) -> None:
        """Step 3: capture the CUDA graphs of every dispatcher key (none on CPU)."""
        got = capture_graphs(self.runner, self.graphs, progress=self.config.progress_bar)
        self.startup.captures = int(got["captures"])
        self.startup.capture_time_s = got["capture_time_s"]

    def _calibrate(self, seed: int) -> None:
        """Static activation scales: absmax over one eager forward of seeded random tokens."""
        gen = torch.Generator().manual_seed(seed)
        n = min(self.config.max_num_tokens, 64)
        tokens = torch.randint(self.model_config.vocab_size, (n,), generator=gen).tolist()
        compiled, self.runner.forward = self.runner.forward, self.model
        try:
            self.calibrated_scales = calibrate_activation_scales(
                self.model, lambda: self.dummy_run(n, tokens)
            )
        finally:
            self.runner.forward = compiled

    # ------------------------------------------------------------------ steps
    def dummy_run(self, num_tokens: int, token_ids: Optional[list[int]] = None) -> None:
        """One forward over ``num_tokens`` throw-away tokens in KV blocks of their own, freed
        afterwards (traces/compiles on first use), without CUDA graphs; recorded in no step
        time or trace.  The tokens go in as many requests as the block table needs, cut to
        what ``max_num_seqs`` requests can hold."""
        sizes = split_tokens(num_tokens, self.runner.max_request_tokens, self.runner.max_num_seqs)
        with dummy_batch(
            sizes,
            self.block_size,
            token_ids=token_ids[: sum(sizes)] if token_ids is not None else None,
            allocate=self.block_manager.allocate,
            free=self.block_manager.free,
        ) as chunks:
            self.execute(chunks, record=False, graphs=False)

    def execute(
        self,
        chunks: list[ScheduledChunk],
        force: Optional[tuple[CUDAGraphMode, BatchDescriptor]] = None,
        record: bool = True,
        graphs: bool = True,
    ) -> tuple[list[Optional[int]], torch.Tensor]:
        """One step of this rank's runner, under this worker's tensor-parallel state (a
        range compiled on first use sees this engine's group, never another's)."""
        with tp_state(self.tp):
            return self.runner.execute(chunks, force, record, graphs)

    @property
    def last_logprobs(self) -> Optional[list]:
        return self.runner.last_logprobs


def _model_tag(mc) -> str:
    return f"{mc.architecture}-{mc.num_layers}l-{mc.hidden_size}h"
