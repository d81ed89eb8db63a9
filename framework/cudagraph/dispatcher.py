"""The CUDA-graph dispatcher: per step, which runtime mode and which padded batch descriptor.

Built once from the (already support-downgraded) configuration mode and the capture sizes.
Every key it can return is known up front, so :meth:`CudagraphDispatcher.capture_plan` lists
exactly the graphs to capture at start-up and a step never meets an unexpected descriptor.

Keys per configuration mode (``s`` = a capture size, ``q`` = uniform decode query length,
``R`` = max_num_reqs):

=====================  ===============================================  ====================
mode                   FULL keys                                        PIECEWISE keys
=====================  ===============================================  ====================
NONE                   --                                               --
PIECEWISE              --                                               ``(s)``
FULL                   ``(s, num_reqs=min(s, R), uniform=False)``       --
FULL_DECODE_ONLY       ``(s, num_reqs=s//q, uniform=True)`` (q | s)     --
FULL_AND_PIECEWISE     ``(s, num_reqs=s//q, uniform=True)`` (q | s)     ``(s)``
=====================  ===============================================  ====================

A general FULL graph is keyed with ``num_reqs = min(s, max_num_reqs)``: the most requests
``s`` tokens can hold, so the runner pads any batch of at most ``s`` tokens to that many
request slots (zero-length padded requests) and one graph serves every mix.  Uniform keys
need ``s // q <= max_num_reqs``.  Dispatch tries FULL (exact key), then
PIECEWISE (relaxed key), then NONE with the descriptor unpadded; token counts above the
largest capture size always run without graphs.

Dispatch is a few list lookups into tables precomputed per token count (it runs every step).
"""

from __future__ import annotations

import logging
from typing import Optional

from framework.core.config_base import check_sizes
from framework.core.forward_context import BatchDescriptor, CUDAGraphMode

logger = logging.getLogger(__name__)

_NONE, _PIECEWISE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


class CudagraphDispatcher:
    """Chooses ``(runtime mode, padded descriptor)`` for every step."""

    def __init__(
        self,
        cudagraph_mode: CUDAGraphMode,
        capture_sizes: list[int],
        max_num_tokens: int,
        uniform_decode_query_len: int = 1,
        *,
        max_num_reqs: Optional[int] = None,
    ):
        mode = CUDAGraphMode.parse(cudagraph_mode)
        if mode is None:
            raise ValueError(
                "CudagraphDispatcher: cudagraph_mode must be set (resolve the "
                "CompilationConfig first)"
            )
        if (
            isinstance(max_num_tokens, bool)
            or not isinstance(max_num_tokens, int)
            or max_num_tokens <= 0
        ):
            raise ValueError(
                f"CudagraphDispatcher: max_num_tokens must be a positive int, "
                f"got {max_num_tokens!r}"
            )
        q = uniform_decode_query_len
        if isinstance(q, bool) or not isinstance(q, int) or q <= 0:
            raise ValueError(
                f"CudagraphDispatcher: uniform_decode_query_len must be a positive int, got {q!r}"
            )
        if max_num_reqs is not None and (
            isinstance(max_num_reqs, bool) or not isinstance(max_num_reqs, int) or max_num_reqs <= 0
        ):
            raise ValueError(
                f"CudagraphDispatcher: max_num_reqs must be a positive int or "
                f"None, got {max_num_reqs!r}"
            )
        if capture_sizes is None or not isinstance(capture_sizes, (list, tuple)):
            raise ValueError(
                f"CompilationConfig.cudagraph_capture_sizes: expected a list of "
                f"token counts, got {capture_sizes!r}"
            )
        check_sizes(
            "CompilationConfig",
            "cudagraph_capture_sizes",
            list(capture_sizes),
            upper=max_num_tokens,
        )

        self.cudagraph_mode = mode
        self.capture_sizes = sorted(capture_sizes)
        self.max_num_tokens = max_num_tokens
        self.uniform_decode_query_len = q
        self.max_capture_size = self.capture_sizes[-1] if self.capture_sizes else 0
        self.max_num_reqs = max_num_reqs if max_num_reqs is not None else max_num_tokens
        r_max = self.max_num_reqs
        if mode is not _NONE and not self.capture_sizes:
            logger.info(
                "cudagraph_mode %s with no capture sizes: every step runs without graphs", mode.name
            )

        self._keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {_FULL: set(), _PIECEWISE: set()}
        # A uniform key needs s // q request slots in the runner's buffers.
        uniform_sizes = [s for s in self.capture_sizes if s % q == 0 and s // q <= r_max]
        if mode in (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE):
            self._keys[_FULL].update(BatchDescriptor(s, s // q, True) for s in uniform_sizes)
        if mode is _FULL:
            self._keys[_FULL].update(
                BatchDescriptor(s, min(s, r_max), False) for s in self.capture_sizes
            )
        if mode.has_piecewise():
            self._keys[_PIECEWISE].update(
                BatchDescriptor(s, None, False) for s in self.capture_sizes
            )

        # Lookup tables indexed by num_tokens (num_tokens <= max_capture_size).
        pad_all = _padding_table(self.capture_sizes, self.max_capture_size)
        pad_uniform = _padding_table(uniform_sizes, self.max_capture_size)
        self._padded = pad_all
        self._full_uniform = self._table(_FULL, pad_uniform, lambda s: (s, s // q, True))
        self._full_general = self._table(_FULL, pad_all, lambda s: (s, min(s, r_max), False))
        self._piecewise = self._table(_PIECEWISE, pad_all, lambda s: (s, None, False))

    def _table(
        self, mode: CUDAGraphMode, padding: list[Optional[int]], key_of
    ) -> list[Optional[tuple[CUDAGraphMode, BatchDescriptor]]]:
        """For each token count, ``(mode, key)`` of its padded size when ``mode`` has that
        key, else None."""
        table: list[Optional[tuple[CUDAGraphMode, BatchDescriptor]]] = []
        for padded in padding:
            key = None if padded is None else BatchDescriptor(*key_of(padded))
            table.append((mode, key) if key in self._keys[mode] else None)
        return table

    def keys(self, runtime_mode: CUDAGraphMode) -> set[BatchDescriptor]:
        """Every descriptor this dispatcher can return with ``runtime_mode`` (FULL or
        PIECEWISE)."""
        return set(self._keys.get(runtime_mode, ()))

    def padded_num_tokens(self, num_tokens: int) -> int:
        """The smallest capture size >= ``num_tokens``; ``num_tokens`` itself above the
        largest capture size."""
        if 0 < num_tokens <= self.max_capture_size:
            return self._padded[num_tokens]
        return num_tokens

    def dispatch(
        self, num_tokens: int, num_reqs: int, uniform_decode: bool
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The runtime mode and the descriptor of this step (padded when a graph runs).

        ``uniform_decode``: every request has exactly ``uniform_decode_query_len`` query
        tokens (so ``num_tokens == num_reqs * uniform_decode_query_len``).
        """
        if (
            num_tokens <= 0
            or num_reqs <= 0
            or num_reqs > num_tokens
            or num_tokens > self.max_num_tokens
            or num_reqs > self.max_num_reqs
        ):
            raise ValueError(
                f"CudagraphDispatcher.dispatch: need 0 < num_reqs <= num_tokens "
                f"<= max_num_tokens={self.max_num_tokens} and num_reqs <= "
                f"max_num_reqs={self.max_num_reqs}, got num_tokens={num_tokens}, "
                f"num_reqs={num_reqs}"
            )
        if uniform_decode and num_tokens != num_reqs * self.uniform_decode_query_len:
            raise ValueError(
                f"CudagraphDispatcher.dispatch: uniform_decode with num_tokens={num_tokens} "
                f"and num_reqs={num_reqs} does not match uniform_decode_query_len="
                f"{self.uniform_decode_query_len}"
            )
        if num_tokens <= self.max_capture_size:
            if uniform_decode:
                choice = self._full_uniform[num_tokens]
                if choice is not None:
                    return choice
            choice = self._full_general[num_tokens] or self._piecewise[num_tokens]
            if choice is not None:
                return choice
        return _NONE, BatchDescriptor(num_tokens, num_reqs, uniform_decode)

    def capture_plan(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every (runtime mode, descriptor) to capture at start-up, largest first (later,
        smaller captures then fit into memory the pool already holds)."""
        plan = [(mode, key) for mode in (_FULL, _PIECEWISE) for key in self._keys[mode]]
        plan.sort(key=lambda mk: (-mk[1].num_tokens, mk[0] is not _FULL, mk[1].uniform))
        return plan

    def __repr__(self) -> str:
        return (
            f"CudagraphDispatcher({self.cudagraph_mode.name}, "
            f"sizes={len(self.capture_sizes)} up to {self.max_capture_size}, "
            f"full={len(self._keys[_FULL])}, piecewise={len(self._keys[_PIECEWISE])})"
        )


def _padding_table(sizes: list[int], upper: int) -> list[Optional[int]]:
    """``table[n]`` = the smallest size >= n for n in 0..upper (None past the largest)."""
    table: list[Optional[int]] = [None] * (upper + 1)
    target_index = 0
    for n in range(1, upper + 1):
        while target_index < len(sizes) and sizes[target_index] < n:
            target_index += 1
        table[n] = sizes[target_index] if target_index < len(sizes) else None
    return table
