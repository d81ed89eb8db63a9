"""The decode-step roofline on a tiny eager model: every row is there, the rows add up to the
profiled step, the floors follow from the byte counts, and the attention row is the
attention op's own time."""

import pytest

from experiments.bench import profile_step
from framework import LLM


@pytest.fixture(scope="module")
def result(llama_checkpoint):
    llm = LLM(str(llama_checkpoint), optimization_level=0, max_num_seqs=2, max_model_len=64)
    return llm, profile_step.roofline(llm, batch=2, prompt_len=12, steps=6, bandwidth=10e9)


def test_rows_cover_the_step(result):
    _, r = result
    names = [row.name for row in r["rows"]]
    assert names == list(profile_step.ROWS)
    assert r["steps"] == 5  # 6 decode steps, the last has no successor
    assert all(row.ms >= 0 for row in r["rows"])
    assert sum(row.ms for row in r["rows"]) == pytest.approx(r["step_ms"], rel=1e-6)
    by = {row.name: row for row in r["rows"]}
    for name in ("linears", "attention", "elementwise pieces", "LM head + sampling"):
        assert by[name].ms > 0, name
    assert r["unprofiled_step_ms"] > 0


def test_bytes_and_floors(result):
    llm, r = result
    mc = llm.model_config
    by = {row.name: row for row in r["rows"]}
    # attention reads K and V of every context token: mean context = 12 + 1 + (6 - 1) / 2
    assert by["attention"].bytes == int(
        2 * mc.num_layers * 2 * 15.5 * mc.num_kv_heads * mc.head_dim * 4
    )
    head = llm.model.lm_head.weight
    assert r["weights_bytes"] == by["linears"].bytes + head.numel() * 4
    assert by["host"].floor_ms(r["bandwidth"]) is None
    assert by["linears"].floor_ms(10e9) == pytest.approx(by["linears"].bytes / 1e7)


def test_table_lists_every_row_and_the_final_comparison(result):
    _, r = result
    table = profile_step.format_table(r)
    for name in profile_step.ROWS:
        assert f"| {name} |" in table
    assert table.splitlines()[-1].startswith("| whole step, unprofiled")
    assert "read bandwidth is 10.0 GB/s (given)" in profile_step.format_rates(r)


def test_split_counts_nested_linears_once():
    class Ev:
        def __init__(self, name, s, e):
            self.name = name
            self.time_range = type("R", (), {"start": s, "end": e})()

    events = [
        Ev("profile_step::execute[decode]", 0, 100),
        Ev("profile_step::forward", 10, 80),
        Ev("aten::linear", 10, 30),
        Ev("aten::addmm", 12, 29),  # nested: once
        Ev("piecewise::attention", 40, 60),
        Ev("aten::mm", 45, 50),  # inside attention
        Ev("profile_step::execute[decode]", 120, 200),
    ]
    (step,) = profile_step.split_steps(events)
    assert step == {
        "linears": 20,
        "attention": 20,
        "elementwise pieces": 30,
        "LM head + sampling": 20,
        "host": 30,
        "step": 120,
    }


def test_bad_arguments():
    with pytest.raises(SystemExit):
        profile_step.parse_args(["--steps", "1"])
    with pytest.raises(SystemExit):
        profile_step.parse_args(["--batch", "0"])
