"""What a draft model's forward was compiled for, checked before every draft forward.

A drafter compiled for int32 token ids but fed int64 ones produced gibberish drafts in vLLM
(vllm#17211).  Here the draft's input dtypes come from its compiled program's argument record
(:func:`input_spec_of`), and :class:`CheckedForward` stands in front of the draft runner's
forward: an input of another dtype, rank or a token count past the draft's ``max_num_tokens``
is a :class:`DraftInputError` naming the input and what was compiled, never wrong drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from framework.engine.worker import Worker


class DraftInputError(TypeError):
    """The draft's forward got inputs it was not compiled for (dtype, rank or size)."""


@dataclass(frozen=True)
class DraftInputSpec:
    """What the draft's forward was compiled for: checked before every draft forward."""

    input_ids_dtype: torch.dtype
    positions_dtype: torch.dtype
    max_num_tokens: int
    model: str = "draft"

    def check(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        for name, t, want in (
            ("input_ids", input_ids, self.input_ids_dtype),
            ("positions", positions, self.positions_dtype),
        ):
            if not isinstance(t, torch.Tensor):
                raise DraftInputError(
                    f"draft model {self.model}: {name} must be a tensor, got {type(t).__name__}"
                )
            if t.dtype != want:
                raise DraftInputError(
                    f"draft model {self.model}: {name} is {t.dtype} but the draft was compiled "
                    f"for {want}; feeding it would give wrong drafts (build the draft's "
                    f"inputs with the dtype it was compiled for)"
                )
            if t.dim() != 1:
                raise DraftInputError(
                    f"draft model {self.model}: {name} must be 1-d (one entry per token), "
                    f"got shape {tuple(t.shape)}"
                )
        if input_ids.shape != positions.shape:
            raise DraftInputError(
                f"draft model {self.model}: input_ids {tuple(input_ids.shape)} and positions "
                f"{tuple(positions.shape)} differ in length"
            )
        if input_ids.shape[0] > self.max_num_tokens:
            raise DraftInputError(
                f"draft model {self.model}: {input_ids.shape[0]} tokens exceed the "
                f"{self.max_num_tokens} the draft was compiled for (max_num_tokens)"
            )


class CheckedForward:
    """The draft runner's forward, behind :meth:`DraftInputSpec.check`."""

    def __init__(self, forward: Callable[..., torch.Tensor], spec: DraftInputSpec):
        self.forward = forward
        self.spec = spec

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.spec.check(input_ids, positions)
        return self.forward(input_ids, positions)


def input_spec_of(worker: Worker, model: str) -> DraftInputSpec:
    """The dtypes the draft's forward was traced with (the compiled program's argument
    record), falling back to the runner's input buffers for an eager draft; the two must
    agree."""
    runner = worker.runner
    spec = DraftInputSpec(
        runner.input_ids.dtype, runner.positions.dtype, runner.max_num_tokens, model
    )
    trace = worker.compiled.trace_once
    binding = trace.binding if trace is not None else None
    if binding is not None:
        names = trace.arg_names
        traced = {names[idx]: dtype for idx, dtype, _ in binding.arg_meta}
        for name, have in (
            ("input_ids", spec.input_ids_dtype),
            ("positions", spec.positions_dtype),
        ):
            if name in traced and traced[name] != str(have):
                raise DraftInputError(
                    f"draft model {model}: compiled for {name} of {traced[name]} but its "
                    f"runner stages {have}; clear the draft's cache entry"
                )
    return spec


__all__ = ["CheckedForward", "DraftInputError", "DraftInputSpec", "input_spec_of"]
