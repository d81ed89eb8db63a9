"""Generated README tables agree with their committed results files
(experiments/report/readme_tables.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.report import readme_tables as rt

ROOT = Path(__file__).resolve().parents[3]
READMES = rt.readme_files(ROOT)


def test_every_generated_table_matches_its_results_file():
    seen = []
    for path in READMES:
        text = path.read_text(encoding="utf-8")
        _, changed = rt.regenerate(text, ROOT, str(path))
        assert not changed, (
            f"{path}: regenerate with `python -m experiments.report.readme_tables`: {changed}"
        )
        seen += [b.name for b in rt.blocks(text.split("\n"), str(path))]
    # the READMEs' result tables are generated, each from its own file
    assert {
        "ablate_passes",
        "ablate_compile",
        "aa_noise_10",
        "serve_bench",
        "spec_bench",
        "moe_bench",
    } <= set(seen)


def test_no_readme_holds_a_result_table_written_by_hand():
    assert len(READMES) >= 8, READMES  # the top-level README and every area's
    hand = [w for p in READMES for w in rt.hand_written_result_tables(p.read_text(), str(p))]
    assert not hand, f"result tables without a results file (generate or delete them): {hand}"


def test_a_hand_written_result_table_is_found_and_fails_the_check(tmp_path):
    text = (
        "# x\n\n| level | compile |\n|---|---|\n| O1 | Inductor |\n\n"
        "| configuration | decode ms |\n|---|---|\n| O2 | 6.95 ms |\n"
    )
    assert rt.hand_written_result_tables(text, "R.md") == ["R.md:7"]
    readme = tmp_path / "README.md"
    readme.write_text(text)
    assert rt.main(["--check", str(readme)]) == 1


def test_a_hand_edit_inside_a_block_is_caught_and_rewritten():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.split("\n")
    block = next(b for b in rt.blocks(lines) if b.name == "ablate_compile")
    row = next(i for i in range(block.start, block.end) if "`compile=O2`" in lines[i])
    lines[row] = lines[row].replace("|", "| 9.99 |", 1)
    new, changed = rt.regenerate("\n".join(lines), ROOT)
    assert changed == ["ablate_compile"]
    assert new == text
    assert rt.main(["--check", str(ROOT / "README.md")]) == 0


def test_check_exits_nonzero_on_a_stale_file(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- table: serve_bench -->\n| stale |\n<!-- /table -->\n")
    assert rt.main(["--check", str(readme)]) == 1
    assert "| stale |" in readme.read_text()
    assert rt.main([str(readme)]) == 0
    assert rt.main(["--check", str(readme)]) == 0
    assert "| stale |" not in readme.read_text()


def test_unknown_table_and_unclosed_block_are_clear_errors():
    with pytest.raises(KeyError, match="unknown readme table 'nope'"):
        rt.regenerate("<!-- table: nope -->\n<!-- /table -->")
    with pytest.raises(ValueError, match="README.md:1: table 'serve_bench' has no"):
        rt.blocks(["<!-- table: serve_bench -->", "| a |"], "README.md")
