"""The public entry point: load a Hugging Face folder, compile per the config, generate.

    from framework import LLM, SamplingParams
    llm = LLM(model_dir, dtype="float32", optimization_level=0)
    outs = llm.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)   # new tokens, greedy
    outs = llm.generate(["Hello"], sampling_params=SamplingParams(temperature=0.8, seed=1))
    rid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=8))  # the step API
    while llm.has_unfinished():
        for out in llm.step(): ...
    llm.stats

The LLM wires the parts: the scheduler (queues, admission, preemption), the block manager
(KV blocks, prefix cache), the runner (inputs, forward, the batched sampler).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Optional, Sequence

import torch

from backends.attention.selector import default_backend
from framework.compile.build import CompiledForward, build_forward
from framework.core.config import DEFAULT_LEVEL, CompilationConfig, CompilationMode
from framework.core.parallel_state import kv_head_layout
from framework.cudagraph.emulation import EmulatedGraphOps
from framework.cudagraph.setup import setup_graphs
from framework.engine.block_manager import BlockManager
from framework.engine.capture import capture_graphs, dummy_batch
from framework.engine.kv_cache import KVCacheSpec, allocate_kv_caches, num_blocks_for
from framework.engine.model_prep import load_quantized, process_weights
from framework.engine.outputs import RequestOutput, output_of
from framework.engine.parallel import start_tensor_parallel, startup_guard
from framework.engine.request import Request, validate_max_tokens, validate_token_ids
from framework.engine.runner import ModelRunner
from framework.engine.sampling_params import SamplingParams, params_per_prompt
from framework.engine.scheduler import Scheduler
from framework.engine.stats import StartupStats, compile_stats, memory_stats, step_time_stats
from framework.engine.tokenizer import encode_prompt, load_tokenizer
from models.config import parse_dtype
from passes.quant_schemes import calibrate_activation_scales
from passes.registry import level_passes

logger = logging.getLogger(__name__)


class LLM:
    """A model, its compiled forward, a paged KV cache and a scheduler.

    ``optimization_level`` (0–3) fills every field the ``compilation_config`` leaves unset;
    when both are None the level is 0 (eager).  ``attention_backend`` None picks the device's
    default (:func:`backends.attention.selector.default_backend`).
    ``emulate_cuda_graphs``: run the CUDA-graph machinery (graph modes resolve as on a GPU,
    dispatcher, capture at start-up, replay) through
    :class:`framework.cudagraph.emulation.EmulatedGraphOps` on any device, so graph-capture
    bugs (stale host values, outputs overwritten by another graph's replay) reproduce
    without a GPU; slower than plain execution, for debugging.

    Construction runs three steps, each its own method: :meth:`_load` (weights,
    quantization, tokenizer, KV cache, scheduler), :meth:`_compile` (graph set-up, the
    compiled forward, the runner, calibration, the warm-up forward) and :meth:`_capture`
    (CUDA graphs).  Their timings land in :attr:`startup` (typed) and :attr:`stats`.
    """

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
        tensor_parallel_size: int = 1,
    ):
        # What every tensor-parallel rank rebuilds (framework/engine/parallel.py).
        llm_args = {k: v for k, v in locals().items() if k not in ("self", "tensor_parallel_size")}
        t_start = time.perf_counter()
        torch.manual_seed(seed)
        for name, v in (
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("block_size", block_size),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"LLM.{name}: must be a positive int, got {v!r}")
        for name, v in (
            ("enable_prefix_caching", enable_prefix_caching),
            ("emulate_cuda_graphs", emulate_cuda_graphs),
        ):
            if not isinstance(v, bool):
                raise ValueError(f"LLM.{name}: must be a bool, got {v!r}")
        # Tensor parallelism: None for one process; else this process is rank 0 (or a
        # torchrun rank) and the other ranks build the same LLM in lockstep.
        self._tp = start_tensor_parallel(tensor_parallel_size, llm_args, type(self))
        # Any failure from here on, on any rank, ends as one TensorParallelError naming the
        # rank, with no process left (framework/engine/parallel.py).
        with startup_guard(self._tp):
            if self._tp is not None:
                self._tp.activate()
            self._tp_size = tensor_parallel_size
            tp_device = self._tp.device if self._tp is not None else None
            self.device = torch.device(tp_device or device or "cpu")  # torchrun: cuda:<local>
            self.max_model_len = max_model_len
            self.startup = StartupStats()
            """Typed timings and counts of construction (per instance)."""
            self._next_id = 0
            self._rng = random.Random(seed)
            self._requests: dict[int, Request] = {}
            self._streaming: set[int] = set()
            self._first_logits: dict[int, Optional[torch.Tensor]] = {}

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
            self.startup.startup_s = time.perf_counter() - t_start
            if self._tp is not None:
                self._tp.attach(self)  # rank 0 broadcasts steps from now on; others serve here

    def close(self) -> None:
        """Stop the tensor-parallel workers (no-op for one process; also runs at exit)."""
        if self._tp is not None:
            self._tp.close()

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
    ) -> Optional[str]:
        """Step 1: weights (and quantization), the resolved config, the KV cache, the block
        manager, the tokenizer and the scheduler.  Returns the quantization hash."""
        self.dtype = parse_dtype(dtype)
        self.model, self.model_config, quantized = load_quantized(
            model, self.dtype, self.device, quantization
        )
        self.quant_config, quant_hash, self.quantized_layers = quantized
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
        if self._tp is not None and self.config.debug_dump_path:
            # Each rank dumps into its own folder: the ranks' graphs differ (shards, slices).
            dump = self._tp.rank_path(self.config.debug_dump_path)
            self.config = self.config.replace(debug_dump_path=dump)

        mc = self.model_config
        kv_heads = kv_head_layout(mc.num_kv_heads, self._tp_size)[0]  # this rank's heads
        spec = KVCacheSpec(mc.num_layers, kv_heads, mc.head_dim, self.dtype, block_size)
        num_blocks = num_blocks_for(
            spec,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            memory_bytes=kv_cache_memory_bytes,
        )
        layer_names = self.model.attention_layer_names()
        self.kv_caches = allocate_kv_caches(spec, layer_names, num_blocks, self.device)
        self.allocator = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.tokenizer = load_tokenizer(model)
        self.scheduler = Scheduler(
            self.allocator,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_tokens=self.config.max_num_tokens,
            max_model_len=self.max_model_len,
        )
        return quant_hash

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
        self.packed_layers = process_weights(self.model, self.config)
        self.graphs = setup_graphs(
            self.config,
            attention_backend=attention_backend,
            max_num_seqs=max_num_seqs,
            graph_ops=graph_ops,
        )
        self.compiled: CompiledForward = build_forward(
            self.model,
            self.config,
            model_hash=mc.compute_hash(),
            dtype=self.dtype,
            quant_hash=quant_hash,
            model_tag=model_tag or _model_tag(mc),
            wrap_piece=self.graphs.wrap_piece(),
        )
        self.runner = ModelRunner(
            self.model,
            self.graphs.wrap_forward(self.compiled.forward),
            kv_caches=self.kv_caches,
            block_size=self.scheduler.block_size,
            max_num_seqs=max_num_seqs,
            max_num_tokens=self.config.max_num_tokens,
            max_model_len=self.max_model_len,
            device=self.device,
            attn_backend=attention_backend,
            dispatch=self.graphs.dispatcher.dispatch,
        )
        if self._tp is not None:
            self._tp.handshake()
            self._tp.startup_fail_hook()  # test hook: PIECEWISE_TP_FAIL=<rank>:startup
        self.startup.load_s = time.perf_counter() - t_start
        if self.quant_config is not None:
            self._calibrate(seed)
        if self.config.mode != CompilationMode.NONE:
            t0 = time.perf_counter()
            self.dummy_run(min(self.config.max_num_tokens, 16))
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

    def dummy_run(self, num_tokens: int, token_ids: Optional[list[int]] = None) -> None:
        """One forward over ``num_tokens`` throw-away tokens in KV blocks of their own, freed
        afterwards (traces/compiles on first use); recorded in no step time or trace."""
        with dummy_batch(
            [num_tokens],
            self.scheduler.block_size,
            token_ids=token_ids,
            allocate=self.allocator.allocate,
            free=self.allocator.free,
        ) as chunks:
            self.runner.execute(chunks, record=False)

    # ------------------------------------------------------------------ step API
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: Optional[SamplingParams] = None,
        *,
        stream: bool = False,
        chat_template: bool = False,
    ) -> int:
        """Queue one request; returns its id.  ``prompt``: token ids, or text when the model
        folder has a tokenizer.  ``stream``: ``step`` also returns this request's output
        whenever it grows.  Raises ``ValueError`` (naming the request) for a request that
        could never fit; requests already queued are unaffected."""
        req = self._make_request(prompt, params, chat_template, f"request {self._next_id}")
        self.scheduler.add(req)
        self._next_id += 1
        self._requests[req.req_id] = req
        if stream:
            self._streaming.add(req.req_id)
        return req.req_id

    def _make_request(self, prompt, params, chat_template: bool, name: str) -> Request:
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"{name}: params must be a SamplingParams, got {type(params).__name__}")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{name}: a text prompt needs a tokenizer, and the model "
                    f"folder has no tokenizer.json / tokenizer_config.json"
                )
            text, prompt = (
                prompt,
                encode_prompt(self.tokenizer, prompt, chat_template=chat_template),
            )
        elif chat_template:
            raise ValueError(f"{name}: chat_template applies to text prompts only")
        ids = validate_token_ids(prompt, self.model_config.vocab_size, f"{name} prompt")
        eos = frozenset() if params.ignore_eos else frozenset(self.model_config.eos_token_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return Request(
            self._next_id,
            ids,
            params.max_tokens,
            eos,
            params=params,
            seed=seed,
            logprobs=[] if params.logprobs is not None else None,
            text_prompt=text,
        )

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it (and the streamed
        ones that grew).  If the step raises, every running request is put back in the
        waiting queue with its blocks freed (output so far kept), and the error propagates:
        the engine stays usable."""
        if not self.scheduler.has_work():
            return []
        try:
            chunks = self.scheduler.schedule()
            if not chunks:
                raise RuntimeError("scheduler produced an empty step with work queued")
            sampled, logits = self.runner.execute(chunks)
        except BaseException:
            self.scheduler.recover()
            raise
        logprobs = self.runner.last_logprobs
        row = 0
        grown = []
        for c, tok in zip(chunks, sampled):
            if tok is None:
                continue
            req = c.req
            if not req.output and req.req_id in self._first_logits:
                self._first_logits[req.req_id] = logits[row].float()
            if req.logprobs is not None and logprobs is not None:
                req.logprobs.append(logprobs[row])
            row += 1
            grown.append(req)
        done = self.scheduler.update(chunks, sampled)
        outs = [self._output(r) for r in done]
        for r in done:
            self._requests.pop(r.req_id, None)
            self._streaming.discard(r.req_id)
        outs += [self._output(r) for r in grown if r.req_id in self._streaming and not r.finished]
        return outs

    def abort(self, request_id: int) -> bool:
        """Stop a request and free its blocks; False when it is unknown or already done."""
        req = self.scheduler.abort(request_id)
        self._requests.pop(request_id, None)
        self._streaming.discard(request_id)
        self._first_logits.pop(request_id, None)
        return req is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _output(self, req: Request) -> RequestOutput:
        return output_of(req, self.tokenizer)

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: Optional[int] = None,
        *,
        sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
        ignore_eos: bool = False,
        return_outputs: bool = False,
        chat_template: bool = False,
    ) -> list:
        """Run every prompt to completion, together with anything already queued.

        Returns, per prompt: the new token ids (token-id prompts), the new text (text
        prompts), or the ``RequestOutput`` (``return_outputs=True``).  ``max_new_tokens`` and
        ``ignore_eos``, when given, override the sampling params' ``max_tokens`` /
        ``ignore_eos``; without params decoding is greedy with 16 new tokens."""
        if isinstance(prompts, (str, bytes)) or not all(
            isinstance(p, (list, tuple, str)) for p in prompts
        ):
            raise TypeError(
                "generate takes a list of prompts, each a list of token ids or a string"
            )
        if max_new_tokens is not None:
            validate_max_tokens(max_new_tokens)
        params = params_per_prompt(sampling_params, len(prompts), max_new_tokens, ignore_eos)
        reqs = [
            self._make_request(p, sp, chat_template, f"prompt {i}")
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        for i, r in enumerate(reqs):  # all or nothing: none starts when one can never fit
            r.req_id = self._next_id + i
            try:
                self.scheduler.check_fits(r)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        self._next_id += len(reqs)
        for r in reqs:
            self.scheduler.add(r)
            self._requests[r.req_id] = r
            self._first_logits[r.req_id] = None
        mine = {r.req_id for r in reqs}
        try:
            while any(not r.finished for r in reqs):
                self.step()
        except BaseException:
            for r in reqs:
                if not r.finished:
                    self.abort(r.req_id)
            raise
        finally:
            self.first_token_logits = [self._first_logits.pop(i, None) for i in sorted(mine)]
            """Logits that chose each request's first new token (for agreement checks)."""
        if return_outputs:
            return [self._output(r) for r in reqs]
        if all(isinstance(p, str) for p in prompts) and prompts:
            return [self._output(r).text for r in reqs]
        return [list(r.output) for r in reqs]

    # ------------------------------------------------------------------ stats
    @property
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.config.mode.name,
            "level": self.config.level,
            "cudagraph_mode": self.graphs.mode.name,
            **self.startup.as_dict(),
        }
        out.update(step_time_stats(self.runner.step_times))
        out.update(compile_stats(self.compiled))
        out.update(self.scheduler.stats.as_dict())
        out["kv_blocks_total"] = self.allocator.num_usable
        out["kv_blocks_free"] = self.allocator.num_free
        memory = memory_stats(self.model, self.kv_caches, getattr(self, "packed_layers", []))
        out.update({f"memory_{k}": v for k, v in memory.items()})
        if self.allocator.enable_prefix_caching:
            out.update(self.allocator.stats.as_dict())
        return out


def _model_tag(mc) -> str:
    return f"{mc.architecture}-{mc.num_layers}l-{mc.hidden_size}h"
