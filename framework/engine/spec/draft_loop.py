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


@dataclass
class _Loop:
    """One recorded loop of ``steps`` steps over ``n`` requests."""

    forward: Tape
    """The forward's recording the loop calls (a run checks it is still the one that would
    replay)."""
    tape: Tape
    idx: list[torch.Tensor]
    val: list[torch.Tensor]
    positions: np.ndarray
    slots: np.ndarray
    seq_lens: np.ndarray
    """Rows 1.. of the later steps' inputs, written before every run (``[steps, n]``)."""


@dataclass
class _Recording:
    """The head calls of one Python run of the loop, step by step."""

    n: int
    steps: int
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
        self._loops: collections.OrderedDict[tuple[int, int], _Loop] = collections.OrderedDict()
        self.replays = 0
        """Loops replayed (each stands for ``steps`` draft forwards)."""
        self.recordings = 0
        self.enabled = True
        """False: always the Python loop (the A/B baseline)."""

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
        loop = self._loops.get((n, steps)) if self.enabled else None
        if loop is None:
            return None
        if self.forward_replay.tape_for(ctx, ids, positions) is not loop.forward:
            # The forward records anew (its weights moved, or its recording was dropped):
            # this loop goes too, and the Python run the caller falls back to records again.
            del self._loops[(n, steps)]
            return None
        if not self.runner.later_steps(n, loop.positions, loop.slots, loop.seq_lens):
            return None
        self._loops.move_to_end((n, steps))
        loop.tape.run("draft step loop")
        self.replays += 1
        tokens = torch.stack(loop.idx, dim=1)[:n].tolist()
        finite = torch.stack(loop.val, dim=1)[:n].isfinite().tolist()
        return tokens, finite

    # ------------------------------------------------------------------ recording
    def recording(self, n: int, steps: int) -> Optional[_Recording]:
        """A recording for a Python run of this shape, or None (recorded already, or off)."""
        if not self.enabled or steps < 2 or (n, steps) in self._loops:
            return None
        return _Recording(n, steps)

    def head(
        self, rec: _Recording, hidden: torch.Tensor
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

    def finish(
        self, rec: _Recording, ctx: ForwardContext, ids: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Build the loop of a Python run whose every step's head was recorded (``ctx``: its
        last step's context, whose forward replays the same recording as the first's)."""
        heads = [c for c in rec.calls if c is not None]
        if len(heads) != rec.steps:
            return
        forward = self.forward_replay.tape_for(ctx, ids, positions)
        out = forward.outputs if forward is not None else None
        if not isinstance(out, torch.Tensor) or any(h != out.data_ptr() for h in rec.hidden):
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
        calls: list[NativeCall] = []
        for j in range(steps):
            if j:
                calls += [
                    _copy(ids, rec.outputs[j - 1][1], n * 8),
                    _copy(positions, rows_pos[j], n * 8),
                    _copy(md.slot_mapping, rows_slot[j], n * 8),
                    _copy(md.seq_lens, rows_len[j], n * 4),
                ]
            calls += forward.calls
            calls.append(heads[j])
        keep = [t for outputs in rec.outputs for t in outputs]
        assert self._lib is not None
        tape = Tape(self._lib, calls, None, keep, parts=[forward])
        loop = _Loop(
            forward,
            tape,
            [out[1] for out in rec.outputs],
            [out[2] for out in rec.outputs],
            rows_pos,
            rows_slot,
            rows_len,
        )
        self._loops[(n, steps)] = loop
        while len(self._loops) > MAX_LOOPS:
            self._loops.popitem(last=False)
        self.recordings += 1

    def stats(self) -> dict[str, Any]:
        return {"step_loop_replays": self.replays, "step_loop_recordings": self.recordings}


__all__ = ["MAX_LOOPS", "DraftStepLoop"]
