"""Workload traces: the token count of every step the runner executed.

File format (JSON Lines, UTF-8, one JSON object per line):

* line 1, the header::

    {"format": "piecewise-trace", "version": 1, "max_num_tokens": 2048}

* every further line, one step in execution order::

    {"step": 0, "num_tokens": 37, "num_reqs": 3, "num_decode": 2, "num_prefill_tokens": 35}

  ``num_tokens`` is the *unpadded* number of tokens the step scheduled (what the dispatcher
  pads up to a capture size); ``num_reqs`` the requests in the batch; ``num_decode`` how many
  of them are decode requests (one token each); ``num_prefill_tokens`` the tokens of the
  prefill (or chunked-prefill) requests. Invariants checked on read and write:
  ``num_tokens == num_decode + num_prefill_tokens``, ``1 <= num_tokens <= max_num_tokens``,
  ``0 <= num_decode <= num_reqs``, ``num_reqs >= 1``, and ``step`` strictly increasing.
  Extra keys on a step line are ignored (later versions may add fields); missing keys are an
  error.

The runner (in ``framework``, which may not import ``experiments``) keeps the per-step
counts; ``experiments.run.job`` hands them to :func:`write_trace`. :func:`token_histogram` turns
a trace into the ``{num_tokens: steps}`` histogram that ``experiments.tools.size_chooser``
optimises.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

from framework.core.files import atomic_write_text

FORMAT_NAME = "piecewise-trace"
FORMAT_VERSION = 1
STEP_FIELDS = ("step", "num_tokens", "num_reqs", "num_decode", "num_prefill_tokens")


class TraceFormatError(ValueError):
    """A trace file (or the steps handed to :func:`write_trace`) breaks the format."""


@dataclass(frozen=True)
class TraceStep:
    """One executed step."""

    step: int
    num_tokens: int
    num_reqs: int
    num_decode: int
    num_prefill_tokens: int

    @property
    def is_pure_decode(self) -> bool:
        return self.num_prefill_tokens == 0


@dataclass(frozen=True)
class Trace:
    """A parsed trace file."""

    max_num_tokens: int
    steps: tuple[TraceStep, ...]
    path: Optional[str] = None

    def __len__(self) -> int:
        return len(self.steps)


StepLike = Union[TraceStep, Mapping[str, Any], Any]


def _step_values(step: StepLike) -> dict[str, Any]:
    """Accept a TraceStep, a mapping, or any object with the step attributes."""
    if isinstance(step, TraceStep):
        return asdict(step)
    if isinstance(step, Mapping):
        return dict(step)
    return {name: getattr(step, name) for name in STEP_FIELDS if hasattr(step, name)}


def _check_int(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{where}: field {name!r} must be an integer, got {value!r}")
    return value


def _validate_step(
    where: str, values: Mapping[str, Any], max_num_tokens: int, previous_step: Optional[int]
) -> TraceStep:
    missing = [name for name in STEP_FIELDS if name not in values]
    if missing:
        raise TraceFormatError(
            f"{where}: missing field(s) {missing}; a step needs {list(STEP_FIELDS)}"
        )
    v = {name: _check_int(where, name, values[name]) for name in STEP_FIELDS}
    if not 1 <= v["num_tokens"] <= max_num_tokens:
        raise TraceFormatError(
            f"{where}: num_tokens={v['num_tokens']} is outside [1, max_num_tokens={max_num_tokens}]"
        )
    if v["num_reqs"] < 1:
        raise TraceFormatError(f"{where}: num_reqs must be >= 1, got {v['num_reqs']}")
    if not 0 <= v["num_decode"] <= v["num_reqs"]:
        raise TraceFormatError(
            f"{where}: num_decode={v['num_decode']} must be in [0, num_reqs={v['num_reqs']}]"
        )
    if v["num_prefill_tokens"] < 0:
        raise TraceFormatError(
            f"{where}: num_prefill_tokens must be >= 0, got {v['num_prefill_tokens']}"
        )
    if v["num_decode"] + v["num_prefill_tokens"] != v["num_tokens"]:
        raise TraceFormatError(
            f"{where}: num_tokens={v['num_tokens']} != num_decode ({v['num_decode']}) + "
            f"num_prefill_tokens ({v['num_prefill_tokens']}); every decode request "
            f"contributes one token"
        )
    if previous_step is not None and v["step"] <= previous_step:
        raise TraceFormatError(
            f"{where}: step {v['step']} does not increase (previous step {previous_step})"
        )
    return TraceStep(**v)


def _check_max_num_tokens(where: str, value: Any) -> int:
    value = _check_int(where, "max_num_tokens", value)
    if value < 1:
        raise TraceFormatError(f"{where}: max_num_tokens must be >= 1, got {value}")
    return value


def write_trace(
    path: Union[str, os.PathLike], steps: Iterable[StepLike], max_num_tokens: int
) -> Path:
    """Write ``steps`` to ``path`` in the trace format; returns the path.

    Steps may be :class:`TraceStep` objects, mappings or objects with the step attributes.
    Every step is validated first, so an invalid step never leaves a half-written file
    (the file is written to a temporary name and renamed).
    """
    path = Path(path)
    max_num_tokens = _check_max_num_tokens(f"write_trace({path})", max_num_tokens)
    validated: list[TraceStep] = []
    previous = None
    for index, step in enumerate(steps):
        checked = _validate_step(
            f"write_trace({path}): step #{index}", _step_values(step), max_num_tokens, previous
        )
        validated.append(checked)
        previous = checked.step
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "max_num_tokens": max_num_tokens}
    lines = [json.dumps(header)] + [json.dumps(asdict(step)) for step in validated]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def read_trace(path: Union[str, os.PathLike]) -> Trace:
    """Parse a trace file; errors name the file and the 1-based line number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"trace file {path} does not exist; record one with the "
            f"runner (see experiments/README.md, 'Trace format')"
        )
    steps: list[TraceStep] = []
    max_num_tokens: Optional[int] = None
    previous = None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if not line.strip():
                continue  # tolerate blank lines (e.g. a trailing newline added by an editor)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if max_num_tokens is None:
                max_num_tokens = _read_header(where, obj)
                continue
            step = _validate_step(where, obj, max_num_tokens, previous)
            steps.append(step)
            previous = step.step
    if max_num_tokens is None:
        raise TraceFormatError(
            f"{path}: empty file; expected the header line "
            f'{{"format": "{FORMAT_NAME}", "version": {FORMAT_VERSION}, '
            f'"max_num_tokens": N}}'
        )
    return Trace(max_num_tokens=max_num_tokens, steps=tuple(steps), path=str(path))


def _read_header(where: str, obj: dict) -> int:
    if obj.get("format") != FORMAT_NAME:
        raise TraceFormatError(
            f'{where}: first line must be the header with "format": "{FORMAT_NAME}", got {obj!r}'
        )
    if obj.get("version") != FORMAT_VERSION:
        raise TraceFormatError(
            f"{where}: unsupported trace version {obj.get('version')!r}; "
            f"this reader understands version {FORMAT_VERSION}"
        )
    if "max_num_tokens" not in obj:
        raise TraceFormatError(f"{where}: header lacks 'max_num_tokens'")
    return _check_max_num_tokens(where, obj["max_num_tokens"])


def token_histogram(trace: Trace) -> dict[int, int]:
    """``{num_tokens: number of steps with that count}``, sorted by token count."""
    counts = Counter(step.num_tokens for step in trace.steps)
    return dict(sorted(counts.items()))
