"""Trace file format: round trip, histogram, and errors that name the file and line."""

import json

import pytest

from experiments.run.trace import (
    TraceFormatError,
    TraceStep,
    read_trace,
    token_histogram,
    write_trace,
)


def _steps():
    return [
        TraceStep(0, 40, 2, 1, 39),
        {"step": 1, "num_tokens": 2, "num_reqs": 2, "num_decode": 2, "num_prefill_tokens": 0},
        TraceStep(2, 2, 2, 2, 0),
        TraceStep(5, 17, 1, 0, 17),
    ]


def test_round_trip_and_histogram(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", _steps(), max_num_tokens=64)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"format": "piecewise-trace", "version": 1, "max_num_tokens": 64}
    assert json.loads(lines[2]) == {
        "step": 1,
        "num_tokens": 2,
        "num_reqs": 2,
        "num_decode": 2,
        "num_prefill_tokens": 0,
    }
    trace = read_trace(path)
    assert trace.max_num_tokens == 64 and len(trace) == 4
    assert trace.steps[1].is_pure_decode and not trace.steps[0].is_pure_decode
    assert token_histogram(trace) == {2: 2, 17: 1, 40: 1}


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not valid JSON"),
        ('{"step": 3, "num_tokens": 5, "num_reqs": 1, "num_decode": 1}', "missing field"),
        (
            '{"step": 3, "num_tokens": 5, "num_reqs": 1, "num_decode": 1, "num_prefill_tokens": 3}',
            "num_decode (1) + num_prefill_tokens (3)",
        ),
        (
            '{"step": 3, "num_tokens": 99, "num_reqs": 1, "num_decode": 0, '
            '"num_prefill_tokens": 99}',
            "max_num_tokens=64",
        ),
        (
            '{"step": 0, "num_tokens": 1, "num_reqs": 1, "num_decode": 1, "num_prefill_tokens": 0}',
            "does not increase",
        ),
        (
            '{"step": 3, "num_tokens": 1.0, "num_reqs": 1, "num_decode": 1, '
            '"num_prefill_tokens": 0}',
            "must be an integer",
        ),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"format": "piecewise-trace", "version": 1, "max_num_tokens": 64}\n'
        '{"step": 0, "num_tokens": 1, "num_reqs": 1, "num_decode": 1, '
        '"num_prefill_tokens": 0}\n' + line + "\n"
    )
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert f"{path}:3" in str(info.value) and message in str(info.value)


def test_bad_header_and_empty_file(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text('{"format": "other", "version": 1, "max_num_tokens": 8}\n')
    with pytest.raises(TraceFormatError, match=r"h\.jsonl:1: first line must be the header"):
        read_trace(path)
    path.write_text('{"format": "piecewise-trace", "version": 2, "max_num_tokens": 8}\n')
    with pytest.raises(TraceFormatError, match="unsupported trace version 2"):
        read_trace(path)
    path.write_text("")
    with pytest.raises(TraceFormatError, match="empty file"):
        read_trace(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_trace(tmp_path / "missing.jsonl")


def test_write_rejects_invalid_step_without_leaving_a_file(tmp_path):
    path = tmp_path / "w.jsonl"
    with pytest.raises(TraceFormatError, match=r"step #1: .*outside \[1, max_num_tokens=8\]"):
        write_trace(path, [TraceStep(0, 1, 1, 1, 0), TraceStep(1, 9, 1, 0, 9)], max_num_tokens=8)
    assert not path.exists() and not list(tmp_path.iterdir())
