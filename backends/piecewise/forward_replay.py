"""Replay of a whole forward's native calls: the CPU counterpart of a FULL CUDA graph.

Piece replay (:mod:`backends.piecewise.replay`) runs each lean piece's recorded native calls
from C++, but the forward around the pieces is still Python: the split module's code, each
piece's runtime dispatch and replay bookkeeping, the attention op's glue between the pieces.
At a decode step of a small model that Python is a sizeable part of the step (the default
tiny model at batch 1: ~16% of the calling thread's samples outside the kernels).  So
:class:`ForwardReplay` wraps an engine runner's forward and records, per set of inputs, the
native calls of one whole forward: it runs the forward with a
:class:`~framework.core.native_tape.NativeTapeSink` on its context, every part reports what
it ran -- a piece its tape's calls (:class:`~backends.piecewise.replay.PieceReplay`), the
fused CPU attention its kernel call (``backends/attention/cpu_paged.py``) -- and when every
part of the forward reported (:meth:`PiecewiseBackend.native_parts
<backends.piecewise.backend.PiecewiseBackend.native_parts>` says how many there are: the
split module's pieces and attention calls, nothing else) the calls become one tape.  Later
forwards with the same inputs run that tape in one ctypes call and return the recorded
output, as a FULL CUDA graph replays the whole model.

**The key** is everything the forward's Python reads that can change from step to step:

* the token-id and position tensors (their addresses; the token count, which picks each
  piece's compiled range);
* the attention metadata of the context (one object for every layer, as the runner builds
  it): the number of requests and of real tokens, and the addresses of its tensors (the
  runner's persistent staging buffers: their values change every step, the kernels read
  them when they run), and which attention backend runs;
* the KV cache tensors (their addresses), the batch descriptor and runtime mode.

The model's weights are read at their addresses too: every replay first checks that no
parameter or buffer of the model moved (``param.data = ...``); if one did, every tape is
dropped and the forward records again.  (Weights changed in place need nothing: the
kernels read them when they run.)

**Who may replay**: what piece replay allows (:func:`~backends.piecewise.replay.replay_wanted`:
the runner's ``ForwardContext.cpu_replay`` steps, no profiler, dispatch mode or kernel
override), and the caller must be done with the forward's output before the next forward
with the same inputs -- the runner is.  A replay skips the checks the ops make in Python and
C++ before their kernels (shapes, metadata ranges): the runner's staging is trusted, as a
CUDA graph trusts its captured arguments; the attention kernel still refuses a block outside
the cache (an error naming the call).

Memory: a forward tape holds its parts' tapes (their buffers are those of the piece tapes,
not copies); at most :data:`MAX_TAPES` are kept, least recently used dropped.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from backends.piecewise.replay import MAX_WORDS, Tape, load_replayer, replay_wanted
from framework.core import ops as core_ops
from framework.core.forward_context import (
    ForwardContext,
    get_forward_context,
    set_forward_context,
)
from framework.core.native_tape import NativeTapeSink

MAX_TAPES = 64
"""Forward tapes a runner keeps (one per batch shape it replays; least recently used first)."""
_MAX_REFUSED = 256
_data_ptr = torch.Tensor.data_ptr


class NativeParts(Protocol):
    """What a forward replay needs from the compiled program: how many parts of one forward
    report their native calls, or why no forward can be recorded
    (:meth:`backends.piecewise.backend.PiecewiseBackend.native_parts`); None while that is
    not known yet (the model is not traced)."""

    def native_parts(self) -> Optional[tuple[int, Optional[str]]]: ...


class ForwardReplay:
    """A runner's forward, replayed whole where it can be (see the module docstring).

    ``forward``: the forward it stands for, ``(input_ids, positions) -> hidden states``;
    ``parts``: the compiled program's count of reporting parts; ``state``: the model's
    parameters and buffers (their addresses are checked before every replay)."""

    def __init__(
        self,
        forward: Callable[..., Any],
        parts: NativeParts,
        state: Sequence[torch.Tensor],
    ):
        self.forward = forward
        self._parts = parts
        self._state = list(state)
        self._state_at: Optional[tuple[int, ...]] = None
        self._lib = load_replayer()
        self._tapes: collections.OrderedDict[tuple, Tape] = collections.OrderedDict()
        self._refused: collections.OrderedDict[tuple, bool] = collections.OrderedDict()
        self.enabled = True
        """False: always the forward's own Python (the A/B baseline of
        ``experiments.bench.engine_ab --ab forward_replay``)."""
        self.recorded = 0
        self.replayed = 0
        self.invalidations = 0
        """Times the weights had moved and every tape was dropped."""
        self.refusals: dict[str, int] = {}
        """Why forwards were not recorded (reason -> inputs keys); those run as always."""

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the wrapped forward's attributes.
        forward = self.__dict__.get("forward")
        if forward is None:
            raise AttributeError(name)
        return getattr(forward, name)

    @property
    def refusal(self) -> Optional[str]:
        """Why this forward can never be recorded (None: it can, for the inputs it sees)."""
        if self._lib is None:
            return "no replay library on this platform"
        parts = self._parts.native_parts()
        return "the model is not traced yet" if parts is None else parts[1]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        if not self.enabled or self._lib is None or not replay_wanted():
            return self.forward(input_ids, positions)
        ctx = get_forward_context()
        if ctx.native_tape is not None:  # inside another recording: a part of it
            return self.forward(input_ids, positions)
        key = _key(ctx, input_ids, positions)
        if key is None:
            return self.forward(input_ids, positions)
        tape = self._tapes.get(key)
        if tape is not None:
            if self._weights_moved():
                self._drop_all()
            else:
                self._tapes.move_to_end(key)
                self.replayed += 1
                return tape.run("forward")
        if key in self._refused:
            return self.forward(input_ids, positions)
        return self._record(key, ctx, input_ids, positions)

    def tape_for(
        self, ctx: ForwardContext, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> Optional[Tape]:
        """The recording a forward over these inputs, in ``ctx``, would replay now; None where
        it would not (replay off or not wanted, not recorded, refused, or the weights moved:
        the next forward records again).  For a caller that replays it among other native
        calls (a draft model's step loop, ``framework/engine/spec/draft_loop.py``); the
        caller must stage the inputs exactly as for the forward."""
        if not (self.enabled and self._lib is not None and ctx.cpu_replay):
            return None
        if not core_ops.direct_calls_allowed():  # something watches or overrides ops
            return None
        key = _key(ctx, input_ids, positions)
        tape = None if key is None else self._tapes.get(key)
        if tape is None or self._weights_moved():
            return None
        self._tapes.move_to_end(key)
        return tape

    # ------------------------------------------------------------------ recording
    def _record(
        self, key: tuple, ctx: ForwardContext, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> Any:
        known = self._parts.native_parts()
        if known is None:  # not traced yet (this call may be the one that traces)
            return self.forward(input_ids, positions)
        parts, why = known
        if why is not None:
            self._refuse(key, why)
            return self.forward(input_ids, positions)
        sink = NativeTapeSink()
        with set_forward_context(dataclasses.replace(ctx, native_tape=sink)):
            out = self.forward(input_ids, positions)
        why = sink.refusal
        if why is None and sink.reports != parts:
            why = f"{sink.reports} of the forward's {parts} parts reported their native calls"
        if why is None and any(len(words) > MAX_WORDS for _, _, words, _ in sink.calls):
            why = f"a call of more than {MAX_WORDS} arguments"
        if why is not None:
            self._refuse(key, why)
            return out
        state_at = self._state_pointers()
        if self._state_at is not None and self._state_at != state_at:
            self._drop_all()  # the weights moved since the kept tapes were recorded
        self._state_at = state_at
        assert self._lib is not None
        self._tapes[key] = Tape(self._lib, sink.calls, out, [], parts=sink.parts)
        while len(self._tapes) > MAX_TAPES:
            self._tapes.popitem(last=False)
        self.recorded += 1
        return out

    def _refuse(self, key: tuple, why: str) -> None:
        self._refused[key] = True
        if len(self._refused) > _MAX_REFUSED:
            self._refused.popitem(last=False)
        self.refusals[why] = self.refusals.get(why, 0) + 1

    # ------------------------------------------------------------------ weights
    def _state_pointers(self) -> tuple[int, ...]:
        return tuple(map(_data_ptr, self._state))  # (map: a third faster than a generator)

    def _weights_moved(self) -> bool:
        return self._state_pointers() != self._state_at

    def _drop_all(self) -> None:
        """Every tape and refusal goes (the weights moved: the next forward records again)."""
        self._tapes.clear()
        self._refused.clear()
        self._state_at = None
        self.invalidations += 1

    def stats(self) -> dict[str, Any]:
        return {
            "forward_replays": self.replayed,
            "forward_recordings": self.recorded,
            "forward_tapes": len(self._tapes),
            "forward_replay_refusals": dict(self.refusals),
        }


def _key(ctx: ForwardContext, input_ids: torch.Tensor, positions: torch.Tensor) -> Optional[tuple]:
    """What the forward's Python reads besides the weights (module docstring), or None where
    the layers' attention metadata are not one object (not what the runner builds)."""
    md = None
    for m in ctx.attn_metadata.values():
        if md is None:
            md = m
        elif m is not md:
            return None
    if md is None:
        return None
    return (
        input_ids.data_ptr(),
        tuple(input_ids.shape),
        positions.data_ptr(),
        tuple(positions.shape),
        md.attention_backend,
        md.num_reqs,
        md.num_actual_tokens,
        md.slot_mapping.data_ptr(),
        md.block_table.data_ptr(),
        md.query_start_loc.data_ptr(),
        md.seq_lens.data_ptr(),
        tuple(map(_data_ptr, ctx.kv_caches.values())),
        ctx.batch_descriptor,
        ctx.cudagraph_runtime_mode,
    )


__all__ = ["MAX_TAPES", "ForwardReplay", "NativeParts"]
