"""The public entry point: load a Hugging Face folder, compile per the config, generate.

    from framework import LLM, SamplingParams
    llm = LLM(model_dir, dtype="float32", optimization_level=0)
    outs = llm.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)   # new tokens, greedy
    outs = llm.generate(["Hello"], sampling_params=SamplingParams(temperature=0.8, seed=1))
    rid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=8))  # the step API
    while llm.has_unfinished():
        for out in llm.step(): ...
    llm.stats

``LLM`` is a facade: it builds this process's :class:`framework.engine.worker.Worker` (the
model, KV cache, compiled forward, CUDA graphs, runner), the executor that drives it
(in-process, or rank 0 of a tensor-parallel group: ``framework.engine.executor``) and the
:class:`framework.engine.core.EngineCore` (requests, scheduler, the step), and forwards the
public API to the core.  Several ``LLM``s in one process own their state: forward context,
tensor-parallel group, CUDA-graph pool.  Calls from several threads are serialised
(``framework.engine.core``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

import torch

from framework.core.config import CompilationConfig
from framework.engine.core import EngineCore, StepObserver
from framework.engine.executor import Executor, InProcessExecutor, TensorParallelExecutor
from framework.engine.llm_stats import compile_stats, memory_stats, step_time_stats
from framework.engine.model_prep import rows_independent
from framework.engine.outputs import RequestOutput
from framework.engine.parallel import (
    run_torchrun_worker,
    start_tensor_parallel,
    startup_guard,
)
from framework.engine.sampling_params import SamplingParams
from framework.engine.scheduler import Scheduler
from framework.engine.spec.config import SpeculativeConfig, speculative_config_of
from framework.engine.spec.decoder import SpecDecoder
from framework.engine.spec.proposer import ProposerContext, build_proposer
from framework.engine.tokenizer import load_tokenizer
from framework.engine.worker import Worker

logger = logging.getLogger(__name__)


def draft_rows_warning(limit: Optional[int], max_num_seqs: int, k: int) -> Optional[str]:
    """The start-up line where steps with drafts are held to ``limit`` tokens
    (``Scheduler.draft_rows_limit``) and a full batch's verify step, ``max_num_seqs x (1 + k)``
    tokens, does not fit: then with every sequence decoding only ``(limit - max_num_seqs) //
    k`` of them get drafts in a step (none where ``max_num_seqs > limit - k``).  None where
    nothing is held back."""
    if limit is None or k <= 0 or limit >= max_num_seqs * (1 + k):
        return None
    fit = max(0, (limit - max_num_seqs) // k)
    return (
        f"speculative decoding: steps with drafts are held to {limit} tokens (the re-laid "
        f"linears' small-M limit, KernelConfig.small_m_max_rows / int8_small_m_max_rows: "
        f"past it a row's bits could depend on the batch), so with {max_num_seqs} requests "
        f"decoding only {fit} of them get drafts in a step; a full verify step needs "
        f"{max_num_seqs * (1 + k)} tokens (raise the limit or lower max_num_seqs)"
    )


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

    Construction: the tensor-parallel group when asked for (its own; none otherwise), the
    tokenizer, then this process's :class:`framework.engine.worker.Worker` (weights and
    quantization, KV cache, graph set-up, the compiled forward, the runner, calibration, the
    warm-up forward, CUDA graphs), its executor, the scheduler and the engine core.  Timings
    land in :attr:`startup` (typed) and :attr:`stats`.  The worker's parts are attributes
    (``model``, ``runner``, ``config``, ``compiled``, ``kv_caches``, ...; rank 0's under
    tensor parallelism).
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
        strict_weights: bool = False,
        speculative_config: Optional[SpeculativeConfig | dict] = None,
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
            ("strict_weights", strict_weights),
        ):
            if not isinstance(v, bool):
                raise ValueError(f"LLM.{name}: must be a bool, got {v!r}")
        spec_config = speculative_config_of(speculative_config)
        if spec_config is not None:
            spec_config.validate_for(None, max_model_len)
            # Every rank builds its worker for 1 + k query tokens (same sizes, same keys);
            # the proposer and the verification run on rank 0.
            llm_args["speculative_config"] = spec_config
        # Tensor parallelism: None for one process; else this process is rank 0 (or a
        # torchrun rank) of a group this LLM owns, and the other ranks build the same worker.
        self._tp = start_tensor_parallel(tensor_parallel_size, llm_args)
        self._tp_size = tensor_parallel_size
        # Any failure from here on, on any rank, ends as one TensorParallelError naming the
        # rank, with no process left (framework/engine/parallel.py).
        with startup_guard(self._tp):
            self.tokenizer = load_tokenizer(model)
            worker = Worker(**llm_args, group=self._tp, t_start=t_start)
            if self._tp is not None and self._tp.rank != 0:
                run_torchrun_worker(self._tp, worker)  # serves rank 0, then ends the process
            executor: Executor = (
                InProcessExecutor(worker)
                if self._tp is None
                else TensorParallelExecutor(self._tp, worker)
            )
            self.executor = executor
            self.worker = worker
            for name in _WORKER_ATTRS:  # the parts, as attributes (rank 0's under TP)
                if hasattr(worker, name):
                    setattr(self, name, getattr(worker, name))
            self.spec = self._speculation(spec_config, worker, cache_dir, seed, block_size)
            limit = self._draft_rows_limit(worker)
            k = spec_config.num_speculative_tokens if self.spec is not None else 0
            note = draft_rows_warning(limit, max_num_seqs, k)
            if note is not None:
                logger.warning("!!! %s", note)
            self.scheduler = Scheduler(
                worker.block_manager,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_tokens=worker.config.max_num_tokens,
                max_model_len=max_model_len,
                on_release=self.spec.release if self.spec is not None else None,
                draft_rows_limit=limit,
            )
            self.engine = EngineCore(
                executor,
                self.scheduler,
                model_config=worker.model_config,
                tokenizer=self.tokenizer,
                seed=seed,
                spec=self.spec,
            )
            self.startup.startup_s = time.perf_counter() - t_start

    @staticmethod
    def _draft_rows_limit(worker: Worker) -> Optional[int]:
        """Tokens up to which a step runs every re-laid linear on its small-M kernel (the
        kernels whose rows do not depend on the rows beside them): the limit of steps with
        drafts (``Scheduler.draft_rows_limit``).  None where no linear was re-laid, or where
        every re-laid layer runs its kernel at any row count (AVX2-only CPUs: bf16 and int8
        linears, bf16 experts; AMX: W8A8 int8 linears, and bf16 ones without a oneDNN view;
        :func:`~framework.engine.model_prep.rows_independent`)."""
        packed = worker.packed_layers
        if not packed or rows_independent(worker.model, packed):
            return None
        kc = worker.config.kernel_config
        rows = [r for r in (kc.max_rows(), kc.int8_max_rows()) if r > 0]
        return min(rows) if rows else None

    @staticmethod
    def _speculation(
        config: Optional[SpeculativeConfig],
        worker: Worker,
        cache_dir: Optional[str],
        seed: int,
        block_size: int,
    ) -> Optional[SpecDecoder]:
        """The proposer for ``config`` (None: speculation off), built after the target."""
        if config is None:
            return None
        config.validate_for(worker.model_config, worker.max_model_len)
        context = ProposerContext(
            model_config=worker.model_config,
            dtype=worker.dtype,
            device=worker.device,
            max_model_len=worker.max_model_len,
            max_num_seqs=worker.runner.max_num_seqs,
            compilation_config=worker.config,
            cache_dir=cache_dir if cache_dir is not None else worker.config.cache_dir,
            block_size=block_size,
            seed=seed,
        )
        proposer = build_proposer(config, context)
        return SpecDecoder(config, proposer, worker.model_config.vocab_size)

    def close(self) -> None:
        """Stop the tensor-parallel workers (no-op for one process; also runs at exit)."""
        self.executor.close()

    def dummy_run(self, num_tokens: int, token_ids: Optional[list[int]] = None) -> None:
        """One forward over ``num_tokens`` throw-away tokens (rank 0's worker only)."""
        self.worker.dummy_run(num_tokens, token_ids)

    # ------------------------------------------------------------------ observers
    def add_observer(self, observer: StepObserver) -> None:
        """Call ``observer.on_step(chunks, sampled, logits)`` after every step's forward
        (``framework.engine.observers.FirstTokenLogits``, say)."""
        self.engine.add_observer(observer)

    def remove_observer(self, observer: StepObserver) -> None:
        self.engine.remove_observer(observer)

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
        return self.engine.add_request(prompt, params, stream=stream, chat_template=chat_template)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it (and the streamed
        ones that grew), after any output of step-API requests that finished inside a
        ``generate`` call since the last ``step``.  If the step raises, every running
        request is put back in the waiting queue with its blocks freed (output so far
        kept), and the error propagates: the engine stays usable."""
        return self.engine.step()

    def abort(self, request_id: int) -> bool:
        """Stop a request and free its blocks; False when it is unknown or already done."""
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        """Requests still to run, or outputs ``step`` has still to return."""
        return self.engine.has_unfinished()

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
        """Run every prompt to completion, together with anything already queued (whose
        outputs the next ``step`` returns).

        Returns, per prompt: the new token ids (token-id prompts), the new text (text
        prompts), or the ``RequestOutput`` (``return_outputs=True``).  ``max_new_tokens`` and
        ``ignore_eos``, when given, override the sampling params' ``max_tokens`` /
        ``ignore_eos``; without params decoding is greedy with 16 new tokens.  Safe to call
        from several threads: the calls run one after another, each returning its own."""
        return self.engine.generate(
            prompts,
            max_new_tokens,
            sampling_params=sampling_params,
            ignore_eos=ignore_eos,
            return_outputs=return_outputs,
            chat_template=chat_template,
        )

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
        out["kv_blocks_total"] = self.block_manager.num_usable
        out["kv_blocks_free"] = self.block_manager.num_free
        memory = memory_stats(self.model, self.kv_caches, self.packed_layers)
        out.update({f"memory_{k}": v for k, v in memory.items()})
        if self.block_manager.enable_prefix_caching:
            out.update(self.block_manager.stats.as_dict())
        if self.worker.forward_replay is not None:
            out.update(self.worker.forward_replay.stats())
        if self.spec is not None:
            out.update(self.spec.stats())
        return out


_WORKER_ATTRS = (
    "device",
    "dtype",
    "max_model_len",
    "startup",
    "model",
    "model_config",
    "quant_config",
    "quantized_layers",
    "calibrated_scales",
    "config",
    "kv_caches",
    "block_manager",
    "graphs",
    "compiled",
    "runner",
    "packed_layers",
    "weights_path",
)
