"""A draft model's single-token steps replayed as one native tape: the CPU counterpart of
capturing a drafter's multi-step loop in one CUDA graph.

A draft proposes up to k tokens per request: its catch-up step, then single-token steps that
feed back the draft just drawn (``draft.py``, ``DraftModelProposer._decode``).  For an
all-greedy batch each of those steps is: advance the inputs (the last drafts become the
token ids; positions, slots and context lengths move one on), the forward (which the
worker's whole-forward replay already runs as one recorded tape,
``backends/piecewise/forward_replay.py``) and the LM head's greedy kernel (logits and first
maximum per row).  Only the token ids depend on the step before: the positions, slots and
lengths of every step are known before the first one runs.  So the whole loop is native
calls::

    step 0:      forward tape; head(hidden -> idx[0], val[0])
    step j >= 1: memcpy(input_ids <- idx[j - 1]); memcpy(positions, slot_mapping, seq_lens
                 <- their row j, written by Python before the run); forward tape;
                 head(hidden -> idx[j], val[j])

:class:`DraftStepLoop` records such a loop the first time a batch shape (requests, steps)
runs through the Python loop -- the head called through its recording kernel
(``RecordedGreedyLogits.record_logits_greedy``), each step into its own idx/val buffers --
and replays it afterwards: Python stages step 0 (``build_context``, as before), writes the
later steps' rows (``ModelRunner.later_steps``), makes one replay call and reads the tokens
once.  Same kernels, same inputs, same buffers: the same drafts as the Python loop, bit for
bit; the staging arrays end as :meth:`ModelRunner.advance` would leave them.

**With the catch-up.**  When a propose call's catch-up is one forward that replays whole
too (a few tokens per request: the prompt of a short request, the tokens accepted since the
last call) and every request wants the same number of drafts, the catch-up joins the tape::

    catch-up:    forward tape over the catch-up's tokens; memcpy each request's last row of
                 its output into a gather buffer; head(buffer -> idx[c], val[c])
    then:        memcpy(input_ids <- idx[c]); memcpy(positions, slot_mapping, seq_lens <-
                 row 0; query_start_loc <- 0..n)
                 -- the single-token batch's staging, written over the catch-up's --
                 and the steps above

so a whole propose call is one staging in Python (the catch-up's ``build_context`` and the
steps' rows, :meth:`ModelRunner.single_token_rows`), one replay call and one read of the
tokens.  Such a loop is keyed by its catch-up's shape too (tokens, the rows it samples) and
recorded by a Python run of the same shape that went through the catch-up and the steps
(``DraftModelProposer._catch_up``).

It runs only where every part can: a runner whose staging arrays are its input buffers
(CPU), a forward the worker replays whole for these inputs (``ForwardReplay.tape_for``:
recorded, the weights where they were; checked on every run) and a head whose greedy call
replays from its words.  Otherwise, and for batches with sampling requests, the Python loop
runs as always.
"""

from __future__ import annotations

import collections
import ctypes
import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from backends.piecewise.forward_replay import ForwardReplay
from backends.piecewise.replay import Tape, load_replayer
from framework.core.forward_context import ForwardContext
from framework.core.native_tape import NativeCall, native_call
from models.family import RecordedGreedyLogits

MAX_LOOPS = 16
"""Recorded loops kept (least recently used dropped first), one per (requests, steps)."""


@functools.lru_cache(maxsize=1)
def _memcpy() -> int:
    """The address of the C library's ``memcpy`` (a call of kind 0: its result is unused)."""
    address = ctypes.cast(ctypes.CDLL(None).memcpy, ctypes.c_void_p).value
    assert address
    return address


def _copy(
    dst: torch.Tensor | np.ndarray, src: torch.Tensor | np.ndarray, nbytes: int
) -> NativeCall:
    return (_memcpy(), 0, [_address(dst), _address(src), nbytes], "memcpy")


def _address(buf: torch.Tensor | np.ndarray) -> int:
    return buf.data_ptr() if isinstance(buf, torch.Tensor) else buf.ctypes.data


CatchUpShape = tuple[int, tuple[int, ...]]
"""A catch-up forward's shape as a loop key: its token count and the rows it samples (the
last token of each request)."""


@dataclass(frozen=True)
class CatchUp:
    """A propose call's catch-up forward, staged (``build_context``) and not run yet."""

    ctx: ForwardContext
    ids: torch.Tensor
    positions: torch.Tensor
    tokens: int
    rows: tuple[int, ...]
    """Per request the row of its last catch-up token (its first draft's hidden state)."""
    first: list[int]
    """Per request the position its first draft will be fed at (its catch-up's end)."""

    @property
    def shape(self) -> CatchUpShape:
        return (self.tokens, self.rows)


@dataclass
class _Loop:
    """One recorded loop of ``steps`` steps over ``n`` requests (after a catch-up forward
    where ``catch_up`` is set)."""

    forward: Tape
    """The single-token forward's recording the loop calls (a run checks it is still the one
    that would replay)."""
    tape: Tape
    idx: np.ndarray
    val: np.ndarray
    """Per draft (``[drafts, n]``) its token and maximum, copied there by the tape's last
    calls (one read of the results)."""
    positions: np.ndarray
    slots: np.ndarray
    seq_lens: np.ndarray
    """Rows of the single-token steps' inputs written before every run (``[steps, n]``): 1..
    after a staged step 0, 0.. after a catch-up."""
    catch_up: Optional[Tape] = None
    """The catch-up forward's recording (checked like ``forward``)."""
    step_inputs: Optional[tuple[ForwardContext, torch.Tensor, torch.Tensor]] = None
    """With a catch-up: the single-token steps' context and inputs as recorded (what
    ``forward`` is looked up with: a run after a catch-up stages no single-token step)."""


@dataclass
class Recording:
    """The head calls of one Python run of the loop, step by step (the catch-up's first,
    where ``catch_up`` is set)."""

    n: int
    steps: int
    catch_up: Optional[CatchUp] = None
    gather: Optional[tuple[int, torch.Tensor]] = None
    """With a catch-up: the address of the forward output its head's rows were gathered from,
    and the gather buffer the head read."""
    outputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    calls: list[Optional[NativeCall]] = field(default_factory=list)
    """Per step the head's native call (None: its words alone cannot replay it)."""
    hidden: list[int] = field(default_factory=list)
    """The address each head call read its rows from (the forward's output buffer)."""


class DraftStepLoop:
    """Records and replays a draft's single-token greedy steps (see the module docstring).
    Build it with :meth:`for_runner`; one per draft model."""

    def __init__(self, runner: Any, forward_replay: ForwardReplay, model: RecordedGreedyLogits):
        self.runner = runner
        self.forward_replay = forward_replay
        self.model = model
        self._lib = load_replayer()
        self._loops: collections.OrderedDict[tuple[int, int, Optional[CatchUpShape]], _Loop] = (
            collections.OrderedDict()
        )
        """Recorded loops by (requests, steps, catch-up shape or None)."""
        self.replays = 0
        """Loops replayed (each stands for ``steps`` draft forwards, and a catch-up's where
        it has one)."""
        self.catch_up_replays = 0
        """Of those, loops replayed with their catch-up forward (a whole propose call)."""
        self.recordings = 0
        self.enabled = True
        """False: always the Python loop (the A/B baseline)."""
        self.joins_catch_up = True
        """False: the catch-up always runs in Python before the loop (the A/B baseline of
        the joined loop)."""

    @classmethod
    def for_runner(
        cls, runner: Any, forward_replay: Optional[ForwardReplay], model: Any
    ) -> Optional["DraftStepLoop"]:
        """The loop for a draft's runner, or None where it could never run: no whole-forward
        replay, staging that is copied to the device, or a head without a recording greedy
        kernel interface."""
        if forward_replay is None or load_replayer() is None:
            return None
        if not runner.stages_in_place or not isinstance(model, RecordedGreedyLogits):
            return None
        return cls(runner, forward_replay, model)

    # ------------------------------------------------------------------ replay
    def run(
        self, ctx: ForwardContext, ids: torch.Tensor, positions: torch.Tensor, n: int, steps: int
    ) -> Optional[tuple[list[list[int]], list[list[bool]]]]:
        """The ``steps`` steps of the staged single-token batch ``ctx`` replayed: per request
        its ``steps`` drafts and whether each one's maximum was finite; None where no loop
        replays these inputs now (then run them in Python, with :meth:`recording`)."""
        key = (n, steps, None)
        loop = self._loops.get(key) if self.enabled else None
        if loop is None or not self._current(key, loop.forward, ctx, ids, positions):
            return None
        if not self.runner.later_steps(n, loop.positions, loop.slots, loop.seq_lens):
            return None
        return self._replay(key, loop)

    def run_after_catch_up(
        self, catch_up: CatchUp, steps: int
    ) -> Optional[tuple[list[list[int]], list[list[bool]]]]:
        """The staged ``catch_up`` forward and ``steps`` single-token steps after it
        replayed: per request its ``1 + steps`` drafts and whether each one's maximum was
        finite; None where no loop replays them now (then run them in Python, recording with
        :meth:`recording`)."""
        n = len(catch_up.rows)
        key = (n, steps, catch_up.shape)
        loop = self._loops.get(key) if self.enabled else None
        if loop is None or loop.step_inputs is None:
            return None
        c = catch_up
        if not self._current(key, loop.catch_up, c.ctx, c.ids, c.positions):
            return None
        if not self._current(key, loop.forward, *loop.step_inputs):
            return None
        if not self.runner.single_token_rows(c.first, loop.positions, loop.slots, loop.seq_lens):
            return None
        return self._replay(key, loop)

    def _current(
        self,
        key: tuple,
        recorded: Optional[Tape],
        ctx: ForwardContext,
        ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> bool:
        """Whether a forward over these inputs would replay ``recorded`` now; where not (its
        weights moved, or its recording was dropped) the loop goes too, and the Python run
        the caller falls back to records it again."""
        if self.forward_replay.tape_for(ctx, ids, positions) is recorded:
            return True
        del self._loops[key]
        return False

    def _replay(self, key: tuple, loop: _Loop) -> tuple[list[list[int]], list[list[bool]]]:
        self._loops.move_to_end(key)
        loop.tape.run("draft step loop")
        self.replays += 1
        self.catch_up_replays += loop.catch_up is not None
        return loop.idx.T.tolist(), np.isfinite(loop.val).T.tolist()

    # ------------------------------------------------------------------ recording
    def recording(
        self, n: int, steps: int, catch_up: Optional[CatchUp] = None
    ) -> Optional[Recording]:
        """A recording for a Python run of this shape (after ``catch_up`` where given), or
        None (recorded already, or off)."""
        shape = catch_up.shape if catch_up is not None else None
        if not self.enabled or steps < (1 if catch_up else 2) or (n, steps, shape) in self._loops:
            return None
        return Recording(n, steps, catch_up)

    def head(
        self, rec: Recording, hidden: torch.Tensor
    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The head's greedy call on ``hidden`` (the step's rows), recorded into ``rec``; None
        where the head has no recording greedy kernel for it (the caller then picks from the
        logits)."""
        got = self.model.record_logits_greedy(hidden)
        if got is None:
            return None
        out, call = got
        rec.outputs.append(out)
        rec.calls.append(native_call(list(call), "greedy head") if call else None)
        rec.hidden.append(hidden.data_ptr())
        return out

    def catch_up_head(
        self, rec: Recording, hidden: torch.Tensor
    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The head's greedy call on the catch-up's sampled rows of ``hidden`` (its forward's
        output), gathered into a buffer the recording keeps; recorded into ``rec`` as its
        first head call.  None as :meth:`head`."""
        assert rec.catch_up is not None and not rec.calls
        rows = rec.catch_up.rows
        if hidden.dim() != 2 or not hidden.is_contiguous():
            return self.head(rec, hidden[list(rows)])
        buffer = hidden.new_empty((len(rows), hidden.shape[1]))
        torch.index_select(hidden, 0, torch.tensor(rows), out=buffer)
        rec.gather = (hidden.data_ptr(), buffer)
        return self.head(rec, buffer)

    def finish(
        self, rec: Recording, ctx: ForwardContext, ids: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Build the loop of a Python run whose every step's head was recorded (``ctx``: its
        last step's context, whose forward replays the same recording as the first's)."""
        heads = [c for c in rec.calls if c is not None]
        if len(heads) != len(rec.calls) or len(heads) != rec.steps + (rec.catch_up is not None):
            return
        forward = self.forward_replay.tape_for(ctx, ids, positions)
        out = forward.outputs if forward is not None else None
        step_hidden = rec.hidden[1:] if rec.catch_up is not None else rec.hidden
        if not isinstance(out, torch.Tensor) or any(h != out.data_ptr() for h in step_hidden):
            return
        md = ctx.attn_metadata[self.runner.layer_names[0]]
        dtypes = (ids.dtype, positions.dtype, md.slot_mapping.dtype, md.seq_lens.dtype)
        if dtypes != (torch.int64, torch.int64, torch.int64, torch.int32):
            return
        n, steps = rec.n, rec.steps
        shape = (steps, n)
        rows_pos = np.zeros(shape, np.int64)
        rows_slot = np.zeros(shape, np.int64)
        rows_len = np.zeros(shape, np.int32)
        keep = [t for outputs in rec.outputs for t in outputs]
        parts = [forward]
        calls: list[NativeCall] = []
        if rec.catch_up is not None:
            got = self._catch_up_calls(
                rec, heads[0], ctx, ids, positions, rows_pos, rows_slot, rows_len
            )
            if got is None:
                return
            catch_up, calls, buffers = got
            keep += buffers
            parts.append(catch_up)
            heads = heads[1:]
        for j in range(steps):
            if j:
                calls += [
                    _copy(ids, rec.outputs[j - (rec.catch_up is None)][1], n * 8),
                    _copy(positions, rows_pos[j], n * 8),
                    _copy(md.slot_mapping, rows_slot[j], n * 8),
                    _copy(md.seq_lens, rows_len[j], n * 4),
                ]
            calls += forward.calls
            calls.append(heads[j])
        drafts = len(rec.outputs)
        idx = np.zeros((drafts, n), np.int64)
        val = np.zeros((drafts, n), np.float32)
        for j, (_, i, v) in enumerate(rec.outputs):
            if (i.dtype, v.dtype, i.numel(), v.numel()) != (torch.int64, torch.float32, n, n):
                return
            calls += [_copy(idx[j], i, n * 8), _copy(val[j], v, n * 4)]
        assert self._lib is not None
        tape = Tape(self._lib, calls, None, keep, parts=parts)
        loop = _Loop(
            forward,
            tape,
            idx,
            val,
            rows_pos,
            rows_slot,
            rows_len,
        )
        if rec.catch_up is not None:
            loop.catch_up = parts[1]
            loop.step_inputs = (ctx, ids, positions)
        key = (n, steps, rec.catch_up.shape if rec.catch_up is not None else None)
        self._loops[key] = loop
        while len(self._loops) > MAX_LOOPS:
            self._loops.popitem(last=False)
        self.recordings += 1

    def _catch_up_calls(
        self,
        rec: Recording,
        head: NativeCall,
        ctx: ForwardContext,
        ids: torch.Tensor,
        positions: torch.Tensor,
        rows_pos: np.ndarray,
        rows_slot: np.ndarray,
        rows_len: np.ndarray,
    ) -> Optional[tuple[Tape, list[NativeCall], list[torch.Tensor]]]:
        """The calls of a recording's catch-up (its forward, the gather of its sampled rows,
        its ``head``) and of the staging of the single-token step 0 over it (``ctx``: a
        single-token step's context); the catch-up forward's recording and the buffers the
        calls read.  None where the catch-up's forward does not replay whole, its head read
        other rows than a gather's, or the single-token step is padded (not on the CPU, the
        only place a loop runs)."""
        c = rec.catch_up
        assert c is not None
        tape = self.forward_replay.tape_for(c.ctx, c.ids, c.positions)
        out = tape.outputs if tape is not None else None
        if rec.gather is None or tape is None or not isinstance(out, torch.Tensor):
            return None
        source, buffer = rec.gather
        if out.data_ptr() != source:
            return None
        if rec.hidden[0] != buffer.data_ptr() or out.dtype != buffer.dtype:
            return None
        md = ctx.attn_metadata[self.runner.layer_names[0]]
        n = rec.n
        if md.num_reqs != n or md.query_start_loc.dtype != torch.int32:
            return None
        if ids.shape[0] != n:  # a padded single-token step (staging would write its pads)
            return None
        row = buffer.shape[1] * buffer.element_size()
        calls = list(tape.calls)
        calls += [
            (_memcpy(), 0, [buffer.data_ptr() + i * row, source + r * row, row], "memcpy")
            for i, r in enumerate(c.rows)
        ]
        calls.append(head)
        qsl = torch.arange(n + 1, dtype=torch.int32)
        buffers = [buffer, qsl]
        calls += [
            _copy(ids, rec.outputs[0][1], n * 8),
            _copy(positions, rows_pos[0], n * 8),
            _copy(md.slot_mapping, rows_slot[0], n * 8),
            _copy(md.seq_lens, rows_len[0], n * 4),
            _copy(md.query_start_loc, qsl, (n + 1) * 4),
        ]
        return tape, calls, buffers

    def stats(self) -> dict[str, Any]:
        return {
            "step_loop_replays": self.replays,
            "step_loop_catch_up_replays": self.catch_up_replays,
            "step_loop_recordings": self.recordings,
        }


__all__ = ["MAX_LOOPS", "CatchUp", "DraftStepLoop", "Recording"]
