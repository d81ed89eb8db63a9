"""The public entry point: load a Hugging Face folder, compile per the config, generate.

    from framework import LLM
    llm = LLM(model_dir, dtype="float32", optimization_level=0)
    outs = llm.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)   # new tokens, greedy
    llm.stats
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Optional, Sequence

import torch

from framework.compile.build import CompiledForward, build_forward
from framework.cudagraph.setup import setup_graphs
from framework.engine.capture import capture_graphs
from framework.core.config import CompilationConfig, CompilationMode
from framework.engine.kv_cache import (BlockAllocator, KVCacheSpec, allocate_kv_caches,
                                num_blocks_for)
from framework.engine.runner import ModelRunner
from framework.engine.scheduler import Request, ScheduledChunk, Scheduler

logger = logging.getLogger(__name__)


class LLM:
    """A model, its compiled forward, a paged KV cache and a scheduler.

    ``optimization_level`` (0–3) fills every field the ``compilation_config`` leaves unset;
    when both are None the level is 0 (eager).
    """

    def __init__(self, model: str, dtype: str | torch.dtype = "float32",
                 optimization_level: Optional[int] = None,
                 compilation_config: Optional[CompilationConfig | dict] = None,
                 quantization: Any = None, max_num_seqs: int = 8, max_model_len: int = 512,
                 cache_dir: Optional[str] = None, seed: int = 0, *,
                 max_num_batched_tokens: Optional[int] = None, block_size: int = 16,
                 attention_backend: str = "torch", kv_cache_memory_bytes: Optional[int] = None,
                 device: Optional[str] = None, model_tag: Optional[str] = None,
                 graph_ops: Any = None):
        from models.config import parse_dtype
        from models.loader import load_model

        t_start = time.perf_counter()
        torch.manual_seed(seed)
        for name, v in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                        ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"LLM.{name}: must be a positive int, got {v!r}")
        self.device = torch.device(device or "cpu")
        self.dtype = parse_dtype(dtype)
        self.model, self.model_config = load_model(model, self.dtype, self.device)
        self.quant_config, quant_hash = self._quantize(quantization)
        cc = compilation_config or CompilationConfig()
        if isinstance(cc, dict):
            cc = CompilationConfig.from_dict(cc)
        if cc.level is None:
            cc = cc.replace(level=0 if optimization_level is None else optimization_level)
        if cache_dir is not None:
            cc = cc.replace(cache_dir=cache_dir)
        max_num_tokens = max_num_batched_tokens or cc.max_num_tokens or max_model_len
        # graph_ops (tests only) supplies emulated CUDA-graph calls, so graph modes resolve
        # as they would on a GPU.
        self.config = cc.resolve(max_num_tokens=max_num_tokens,
                                 has_cuda=self.device.type == "cuda" or graph_ops is not None)
        max_num_tokens = self.config.max_num_tokens
        self.max_model_len = max_model_len

        mc = self.model_config
        spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype, block_size)
        num_blocks = num_blocks_for(spec, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                    memory_bytes=kv_cache_memory_bytes)
        layer_names = self.model.attention_layer_names()
        self.kv_caches = allocate_kv_caches(spec, layer_names, num_blocks, self.device)
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = Scheduler(self.allocator, block_size=block_size,
                                   max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens,
                                   max_model_len=max_model_len)
        self._prepack_lm_head()
        self.graphs = setup_graphs(self.config, attention_backend=attention_backend,
                                   max_num_seqs=max_num_seqs, graph_ops=graph_ops)
        self.compiled: CompiledForward = build_forward(
            self.model, self.config, model_hash=mc.compute_hash(), dtype=self.dtype,
            quant_hash=quant_hash, model_tag=model_tag or _model_tag(mc),
            wrap_piece=self.graphs.wrap_piece())
        self.runner = ModelRunner(
            self.model, self.graphs.wrap_forward(self.compiled.forward),
            kv_caches=self.kv_caches, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_tokens=max_num_tokens, max_model_len=max_model_len, device=self.device,
            attn_backend=attention_backend, dispatch=self.graphs.dispatcher.dispatch)
        self._next_id = 0
        self._startup = {"load_s": time.perf_counter() - t_start}
        if self.quant_config is not None:
            self._calibrate(seed)
        self._warmup()
        self._startup.update(capture_graphs(self.runner, self.graphs,
                                            progress=self.config.progress_bar))
        self._startup["startup_s"] = time.perf_counter() - t_start

    # ------------------------------------------------------------------ setup
    def _quantize(self, quantization: Any) -> tuple[Any, Optional[str]]:
        if quantization is None:
            return None, None
        from framework.core.quantization import QuantizationConfig
        from passes.quant_schemes import quantize_model

        qc = QuantizationConfig.parse(quantization)
        if qc is None:
            return None, None
        self.quantized_layers = quantize_model(self.model, qc)
        return qc, qc.compute_hash()

    def _prepack_lm_head(self) -> None:
        """The LM head runs outside the compiled graph; give it the prepacked path too when
        the ``prepack_linear`` pass is on (it is the largest matmul of a small model)."""
        head = getattr(self.model, "lm_head", None)
        if head is None or "prepack_linear" not in self.config.pass_config.passes:
            return
        from passes.ops_prepack import PrepackedLinearMethod
        if PrepackedLinearMethod.applies_to(head):
            head.linear_method = PrepackedLinearMethod()

    def _calibrate(self, seed: int) -> None:
        """Static activation scales: absmax over one eager forward of seeded random tokens."""
        from passes.quant_schemes import calibrate_activation_scales

        gen = torch.Generator().manual_seed(seed)
        n = min(self.config.max_num_tokens, 64)
        tokens = torch.randint(self.model_config.vocab_size, (n,), generator=gen).tolist()
        compiled, self.runner.forward = self.runner.forward, self.model
        try:
            self.calibrated_scales = calibrate_activation_scales(
                self.model, lambda: self.dummy_run(n, tokens))
        finally:
            self.runner.forward = compiled

    def dummy_run(self, num_tokens: int, token_ids: Optional[list[int]] = None) -> None:
        """One forward over ``num_tokens`` throw-away tokens (traces/compiles on first use)."""
        req = Request(-1, token_ids or [0] * num_tokens, max_new_tokens=1)
        self.scheduler._reserve(req, num_tokens)
        try:
            self.runner.execute([ScheduledChunk(req, 0, num_tokens)])
        finally:
            self.allocator.free(req.block_ids)
            if self.runner.trace:
                self.runner.trace.pop()
        for times in self.runner.step_times.values():
            times.clear()

    def _warmup(self) -> None:
        if self.config.mode == CompilationMode.NONE:
            return
        t0 = time.perf_counter()
        self.dummy_run(min(self.config.max_num_tokens, 16))
        if self.compiled.finalize is not None:
            self.compiled.finalize()
        self._startup["compile_s"] = time.perf_counter() - t0

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int = 16, *,
                 ignore_eos: bool = False) -> list[list[int]]:
        """Greedy generation for every prompt, run together; returns the new tokens."""
        if isinstance(prompt_token_ids, (str, bytes)) or not all(
                isinstance(p, (list, tuple)) for p in prompt_token_ids):
            raise TypeError("generate takes a list of prompts, each a list of token ids")
        eos = frozenset() if ignore_eos else frozenset(self.model_config.eos_token_ids)
        reqs = []
        for p in prompt_token_ids:
            bad = [t for t in p if not 0 <= int(t) < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary "
                                 f"(0..{self.model_config.vocab_size - 1})")
            reqs.append(Request(self._next_id, [int(t) for t in p], max_new_tokens, eos))
            self._next_id += 1
        for r in reqs:
            self.scheduler.add(r)
        first_logits: dict[int, torch.Tensor] = {}
        while self.scheduler.has_work():
            chunks = self.scheduler.schedule()
            sampled, logits = self.runner.execute(chunks)
            row = 0
            for c, tok in zip(chunks, sampled):
                if tok is not None:
                    if not c.req.output:
                        first_logits[c.req.req_id] = logits[row].float()
                    row += 1
            self.scheduler.update(chunks, sampled)
        self.first_token_logits = [first_logits[r.req_id] for r in reqs]
        """Logits that chose each request's first new token (for agreement checks)."""
        return [r.output for r in reqs]

    # ------------------------------------------------------------------ stats
    @property
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.config.mode.name, "level": self.config.level,
                               "cudagraph_mode": self.graphs.mode.name,
                               **self._startup}
        for kind, times in self.runner.step_times.items():
            if times:
                ms = sorted(t * 1e3 for t in times)
                out[f"{kind}_steps"] = len(ms)
                out[f"{kind}_ms_median"] = statistics.median(ms)
                out[f"{kind}_ms_p90"] = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
        c = self.compiled
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


def _model_tag(mc) -> str:
    return f"{mc.architecture}-{mc.num_layers}l-{mc.hidden_size}h"
