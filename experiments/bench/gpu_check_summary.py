"""The GPU check's one table, read from the folder ``scripts/gpu_check.sh`` wrote its results to.

    python -m experiments.bench.gpu_check_summary RESULTS_DIR [MARKS] [NOTE]

prints the table between ``----- README table`` markers (the script tees it to
``table.md``); :func:`check_rows` and :func:`decode_rows` are what
``experiments.report.readme_tables`` renders into scripts/README.md and README.md from the
committed copy of such a folder.  A missing file reads "not run" (or ``NOTE``), so the table
is printed whatever part of the check ran.  Standard library only: it runs on the GPU image
before anything else is known to work.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

MARKS = "gpu or triton_kernel"
"""The pytest selection the check runs."""


def _cell(text: str, width: int = 100) -> str:
    return " ".join(text.split())[:width].replace("|", "/")


def environment(folder: Path) -> str:
    """The check's one environment line, "GPU check: python ..., torch ..., GPU ..."."""
    env = folder / "env.txt"
    line = env.read_text().splitlines()[0].strip() if env.is_file() else "gpu-check env: unknown"
    return line.replace("gpu-check env: ", "GPU check: ")


def decode_results(folder: Path) -> dict[str, dict]:
    """``decode_bench.json``'s results per mode ({} when the benchmark did not run)."""
    path = folder / "decode_bench.json"
    return json.loads(path.read_text())["results"] if path.is_file() else {}


def check_rows(folder: Path, marks: str = MARKS, note: str = "") -> list[tuple[str, str, str]]:
    """(check, result, detail) per part of the check: the tests, TP=2, each decode mode."""
    rows = []
    xml = folder / "tests.xml"
    if xml.is_file():
        s = ET.parse(xml).getroot()
        s = s if s.tag == "testsuite" else s.find("testsuite")
        n, f, e, sk = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        rows.append(
            (
                f'pytest -m "{marks}"',
                f"{n - f - e - sk} passed, {f + e} failed, {sk} skipped",
                f"{float(s.get('time', 0)):.0f} s",
            )
        )
    else:
        rows.append((f'pytest -m "{marks}"', note or "not run", ""))
    tp = folder / "tp_check.json"
    tp_log = folder / "tp.log"
    skipped = (
        [line.strip() for line in tp_log.read_text().splitlines() if "skipped" in line]
        if tp_log.is_file()
        else []
    )
    if tp.is_file():
        rows.append(
            (
                "tensor parallel TP=2 vs TP=1 (O2)",
                "see tp_check.json",
                _cell(json.dumps(json.loads(tp.read_text()))),
            )
        )
    elif skipped:
        rows.append(("tensor parallel TP=2 vs TP=1 (O2)", "skipped", _cell(skipped[-1])))
    else:
        rows.append(("tensor parallel TP=2 vs TP=1 (O2)", note or "not run (see tp.log)", ""))
    results = decode_results(folder)
    if not results:
        rows.append(("decode benchmark (bf16, bs 1/8/32)", note or "not run", ""))
    eager = results.get("eager", {}).get("ms", {})
    for mode, r in results.items():
        if "error" in r:
            rows.append((f"decode {mode}", "failed", _cell(r["error"])))
            continue
        ms = ", ".join(f"bs={b}: {v:.3f}" for b, v in r["ms"].items())
        speed = ", ".join(f"{eager[b] / v:.2f}x" for b, v in r["ms"].items() if b in eager)
        rows.append(
            (
                f"decode {mode} ({r.get('cudagraph_mode') or '-'})",
                f"ms/step {ms}",
                f"vs eager {speed}; startup {r['startup_s']:.1f} s",
            )
        )
    return rows


def check_table(folder: Path, marks: str = MARKS, note: str = "") -> list[str]:
    """The environment line and the check table, as Markdown lines."""
    out = [environment(folder), "", "| check | result | detail |", "|---|---|---|"]
    return out + ["| " + " | ".join(row) + " |" for row in check_rows(folder, marks, note)]


DECODE_LABELS = {
    "eager": "framework O0, eager",
    "no_graphs": "framework O2, no graphs",
    "piecewise": "framework O2, PIECEWISE graphs",
    "full_and_piecewise": "framework O2, FULL_AND_PIECEWISE graphs",
    "hf_eager": "transformers eager",
    "hf_reduce_overhead": 'transformers, `torch.compile(mode="reduce-overhead")`',
}


def decode_rows(folder: Path) -> list[str]:
    """Decode ms per step, one row per mode, one column per batch size (Markdown lines)."""
    results = decode_results(folder)
    batches = sorted({b for r in results.values() for b in r.get("ms", {})}, key=int)
    out = [
        "| mode | " + " | ".join(f"b{b} ms" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    for mode, r in results.items():
        label = DECODE_LABELS.get(mode, mode)
        if "error" in r:
            out.append(f"| {label} | failed: {_cell(r['error'], 60)} |")
            continue
        out.append(f"| {label} | " + " | ".join(f"{r['ms'][b]:.3f}" for b in batches) + " |")
    return out


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    folder = Path(argv[0])
    marks = argv[1] if len(argv) > 1 else MARKS
    note = argv[2] if len(argv) > 2 else ""
    print("----- README table (scripts/gpu_check.sh) -----")
    print("\n".join(check_table(folder, marks, note)))
    print("----- end README table -----")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
