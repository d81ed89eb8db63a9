"""README tables generated from committed results files, and the check that they agree.

A generated table sits between two markers in a Markdown file::

    <!-- table: ablate_compile -->
    ... (written by this module; do not edit by hand) ...
    <!-- /table -->

``python -m experiments.report.readme_tables`` rewrites every block of the given files (default:
every README.md of the project, :func:`readme_files`) from its results file; ``--check``
rewrites nothing and exits 1 naming each block that differs from what its file gives, or whose
name is unknown, and each result table written by hand outside a block
(:func:`hand_written_result_tables`).  ``tests/experiments/report/test_readme_tables.py`` runs
the check, so a table and its file cannot drift apart.

Each block starts with a line naming its results file and the command that produced it.
Tables are registered with :func:`table` (name -> generator over the project root); a
generator reads only committed files and formats them, it never measures.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from experiments.bench import gpu_check_summary, peer_summary
from experiments.bench.targets import markdown as target_markdown

ROOT = Path(__file__).resolve().parents[2]
BEGIN = re.compile(r"^<!-- table: ([a-z0-9_]+) -->$")
END = "<!-- /table -->"


@dataclass(frozen=True)
class Table:
    name: str
    source: str
    """The results file or folder, relative to the project root."""
    command: str
    """The command that wrote ``source``."""
    render: Callable[[Path], list[str]]


TABLES: dict[str, Table] = {}


def table(name: str, source: str, command: str):
    """Register a generator ``render(source_path) -> markdown lines``."""

    def deco(fn: Callable[[Path], list[str]]) -> Callable[[Path], list[str]]:
        if name in TABLES:
            raise ValueError(f"readme table {name!r} is registered twice")
        TABLES[name] = Table(name, source, command, fn)
        return fn

    return deco


def render(name: str, root: Path = ROOT) -> list[str]:
    """The block's lines (without the markers) for table ``name``."""
    t = TABLES.get(name)
    if t is None:
        raise KeyError(f"unknown readme table {name!r} (known: {', '.join(sorted(TABLES))})")
    src = root / t.source
    if not src.exists():
        raise FileNotFoundError(f"readme table {name!r}: results file {t.source} is missing")
    head = (
        f"Generated from `{t.source}` (written by `{t.command}`) by "
        f"`python -m experiments.report.readme_tables`."
    )
    return [head, ""] + t.render(src)


# ---------------------------------------------------------------------------- markdown files
@dataclass
class Block:
    name: str
    indent: str
    """The opening marker's indentation, given to every generated line (a table inside a
    list item)."""
    start: int
    """Index of the line after the opening marker."""
    end: int
    """Index of the closing marker."""


def blocks(lines: Sequence[str], path: str = "<text>") -> list[Block]:
    out = []
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i].strip())
        if m:
            try:
                j = next(k for k in range(i + 1, len(lines)) if lines[k].strip() == END)
            except StopIteration:
                raise ValueError(f"{path}:{i + 1}: table {m.group(1)!r} has no {END}") from None
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            out.append(Block(m.group(1), indent, i + 1, j))
            i = j
        i += 1
    return out


def regenerate(text: str, root: Path = ROOT, path: str = "<text>") -> tuple[str, list[str]]:
    """``text`` with every block rewritten; and the names of the blocks that changed."""
    lines = text.split("\n")
    changed = []
    for b in reversed(blocks(lines, path)):
        new = [(b.indent + line) if line else line for line in render(b.name, root)]
        if lines[b.start : b.end] != new:
            changed.append(b.name)
            lines[b.start : b.end] = new
    return "\n".join(lines), changed[::-1]


MEASURED = re.compile(r"\d+\.\d+\s*(?:ms|µs|us|s|GB/s|GB|MB|x|×|%)(?![\w/])")
"""A measured number in a table cell: a decimal with a unit (ms, s, GB, x, %...)."""


def hand_written_result_tables(text: str, path: str = "<text>") -> list[str]:
    """``path:line`` of every Markdown table outside the generated blocks that holds a measured
    number: a result table that no results file backs (descriptive tables hold none)."""
    lines = text.split("\n")
    inside = set()
    for b in blocks(lines, path):
        inside.update(range(b.start - 1, b.end + 1))
    found, fence, start = [], False, None
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fence = not fence
        is_row = not fence and i not in inside and line.lstrip().startswith("|")
        if is_row and start is None:
            start = i
        if start is not None and (not is_row or i == len(lines) - 1):
            end = i + 1 if is_row else i
            if any(MEASURED.search(row) for row in lines[start + 2 : end]):
                found.append(f"{path}:{start + 1}")
            start = None
    return found


def readme_files(root: Path = ROOT) -> list[Path]:
    """Every README.md of the project (not under a virtualenv, a run folder or a results folder)."""
    skip = {"multirun", "outputs", "results", "node_modules", "build"}
    return sorted(
        p
        for p in root.rglob("README.md")
        if not any(part in skip or part.startswith(".") for part in p.relative_to(root).parts)
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.report.readme_tables", description=__doc__
    )
    p.add_argument("files", nargs="*", default=[str(f) for f in readme_files()])
    p.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 on a mismatch")
    args = p.parse_args(argv)
    bad = 0
    for f in args.files:
        path = Path(f)
        text = path.read_text(encoding="utf-8")
        new, changed = regenerate(text, ROOT, str(path))
        for name in changed:
            print(f"{path}: table {name!r} differs from {TABLES[name].source}")
        hand = hand_written_result_tables(text, str(path))
        for where in hand:
            print(f"{where}: a result table written by hand (generate it from a results file)")
        if changed and not args.check:
            path.write_text(new, encoding="utf-8")
        bad += len(changed) + len(hand)
    return 1 if bad and args.check else 0


# ---------------------------------------------------------------------------- the tables
def _report_lines(folder: Path) -> list[str]:
    from experiments.report.sweep_report import build_report

    return build_report(folder, plots=False).split("\n")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _first_table(lines: Sequence[str], after: int = 0) -> tuple[list[str], list[list[str]]]:
    i = next(k for k in range(after, len(lines)) if lines[k].startswith("|"))
    header = _cells(lines[i])
    rows = []
    for line in lines[i + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return header, rows


def _head(*columns: str) -> list[str]:
    """A Markdown table's header row and separator."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _select(header: list[str], rows: list[list[str]], columns: Sequence[str]) -> list[str]:
    idx = [header.index(c) for c in columns]
    out = _head(*(header[i] or " " for i in idx))
    out += ["| " + " | ".join(r[i] for i in idx) + " |" for r in rows]
    return out


def _on_cpu(m: Optional[dict]) -> str:
    """' on <CPU> (<kernel ISA flags>)' from a results file's ``machine`` record
    (:func:`experiments.bench.machine.machine`); empty for a file from before it was kept."""
    if not m or "isa" not in m:
        return ""
    return f" on {m.get('cpu') or 'a CPU'} ({', '.join(m['isa']) or 'no AVX2'})"


@table(
    "ablate_passes",
    "experiments/bench/results/ablations/ablate_passes",
    "python -m experiments.run -m experiment=ablate_passes",
)
def _ablate_passes(folder: Path) -> list[str]:
    header, rows = _first_table(_report_lines(folder))
    return _select(
        header,
        rows,
        [
            "",
            "toggle_passes",
            "decode median ms",
            "tokens/s",
            "token agreement vs baseline",
            "token agreement vs O0",
        ],
    )


@table(
    "ablate_compile",
    "experiments/bench/results/ablations/ablate_compile",
    "python -m experiments.run -m experiment=ablate_compile",
)
def _ablate_compile(folder: Path) -> list[str]:
    lines = _report_lines(folder)
    at = next(i for i, line in enumerate(lines) if line.startswith("#### Does compiling pay off"))
    header, rows = _first_table(lines, at)
    intro = next(line for line in lines[at + 1 :] if line.strip())
    return [intro, ""] + _select(header, rows, header)


_DELTA = re.compile(
    r"decode median ms ([+-]\d+\.\d)% \[[^\]]*\] q=(\S+) (significant|within noise)"
)


@table(
    "aa_noise_10",
    "experiments/bench/results/ablations",
    "python -m experiments.run -m experiment=aa_noise 'seed=range(0,10)'",
)
def _aa_noise(folder: Path) -> list[str]:
    out = [
        *_head(
            "run",
            "significant verdicts (all measures)",
            "smallest decode q",
            "decode deltas up / down",
            "mean decode delta",
        ),
    ]
    runs = sorted(p for p in folder.glob("aa_noise_10_run*") if p.is_dir())
    if not runs:
        raise FileNotFoundError(f"readme table 'aa_noise_10': no aa_noise_10_run* in {folder}")
    for run in runs:
        lines = _report_lines(run)
        at = next(i for i, line in enumerate(lines) if line.startswith("#### Deltas"))
        deltas = [line for line in lines[at + 1 :] if line.startswith("- ")]
        found = [_DELTA.search(line) for line in deltas]
        decode = [(float(m.group(1)), float(m.group(2))) for m in found if m]
        significant = sum(line.count(" significant") for line in deltas)
        up = sum(d > 0 for d, _ in decode)
        out.append(
            f"| {run.name.rsplit('run', 1)[1]} | {significant} | {min(q for _, q in decode):.3g} | "
            f"{up} / {len(decode) - up} | {statistics.fmean(d for d, _ in decode):+.1f}% |"
        )
    return out


_SPEC_OPTION_AB = {
    "_draft_steps": "The draft's native greedy steps (its head's greedy kernel, its single-token "
    "steps replayed as one recording) against its Python steps with logits and a separate "
    "argmax (tokens/s, same rounds): ",
    "_catch_up_joined": "The draft's catch-up joining that recording (a whole propose call "
    "replayed as one tape) against its catch-up in Python before it (tokens/s, same rounds): ",
}
"""The spec bench's A/Bs of one engine option (result-key suffix -> the sentence before its
ratios), each one line under the table."""


@table(
    "spec_bench",
    "experiments/bench/results/spec_bench_cpu.json",
    "python -m experiments.bench.spec --rounds 5 --prompts 4 "
    "--out experiments/bench/results/spec_bench_cpu.json",
)
def _spec_bench(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    res = data["results"]
    out = [
        f"{data['date_utc']}, load average {data['machine']['load_average_before'][0]:.2f} "
        f"before, {data['machine']['torch_threads']} threads{_on_cpu(data['machine'])}.",
        "",
        *_head(
            "workload",
            "batch",
            "tokens/s plain",
            "tokens/s spec",
            "spec / plain [95%]",
            "same tokens",
        ),
    ]
    rows = sorted(k for k, v in res.items() if isinstance(v, dict) and "speedup" in v)
    option_ab = {k: s for k in rows for s in _SPEC_OPTION_AB if f"{s} " in k}
    for key in (k for k in rows if k not in option_ab):
        v = res[key]
        sp = v["speedup"]
        lo, hi = sp["ci95"]
        out.append(
            f"| {key.split(' ')[0]} | {v['batch']} | {v['tokens_per_s']['plain']:.1f} | "
            f"{v['tokens_per_s']['spec']:.1f} | **{sp['ratio']:.2f}** [{lo:.2f}, {hi:.2f}] | "
            f"{'yes' if v['same_tokens'] else 'NO'} |"
        )
    for suffix, sentence in _SPEC_OPTION_AB.items():
        parts = [
            f"{k.replace(suffix, '')} {res[k]['speedup']['ratio']:.2f}x "
            f"[{res[k]['speedup']['ci95'][0]:.2f}, {res[k]['speedup']['ci95'][1]:.2f}]"
            f"{'' if res[k]['same_tokens'] else ' (tokens DIFFER)'}"
            for k, s in option_ab.items()
            if s == suffix
        ]
        if parts:
            out += ["", sentence + ", ".join(parts) + "."]
    for name in sorted(k for k in res if k.endswith("_acceptance")):
        a = res[name]
        if a:
            out += [""]
            out.append(
                f"{name.split('_acceptance')[0]}: acceptance {a['spec_acceptance_rate']:.2f}, "
                f"mean accepted length {a['spec_mean_accepted_length']:.2f} "
                f"(k = {a['spec_num_speculative_tokens']})."
            )
    vs = res.get("verify_step")
    if vs:
        parts = [
            f"b{b} {r['ratio_median']:.2f}x "
            f"({r['verify_ms_median']:.2f} vs {r['decode_ms_median']:.2f} ms)"
            for b, r in sorted(vs["batches"].items(), key=lambda kv: int(kv[0]))
        ]
        out += [
            "",
            f"Verify step of 1 + {vs['k']} tokens vs a decode step: " + ", ".join(parts) + ".",
        ]
        peak = vs.get("matmul_peak")
        floors = [
            f"b{b} {r['compute_floor_ms']:.2f} ms ({r['ratio_floor']:.2f}x the decode step)"
            for b, r in sorted(vs["batches"].items(), key=lambda kv: int(kv[0]))
            if "compute_floor_ms" in r
        ]
        if peak and floors:
            out += [
                "",
                "The verify step's compute floor, its matmul FLOPs at the best torch.mm rate "
                f"measured in the run ({peak['best_gflops']:.0f} GFLOP/s {peak['dtype']}, "
                "`experiments.bench.compute`): " + ", ".join(floors) + ".",
            ]
    if data.get("targets"):
        out += ["", *target_markdown(data["targets"])]
    return out


@table(
    "serve_bench",
    "experiments/bench/results/serve_bench_cpu.json",
    "python -m experiments.bench.serve --concurrency 1,16 --requests 32 --max-tokens 64 "
    "--rounds 3 --out experiments/bench/results/serve_bench_cpu.json",
)
def _serve_bench(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    out = [
        *_head(
            "concurrency",
            "server tok/s",
            "offline tok/s",
            "server / offline (median; rounds)",
            "TTFT p50 / p99",
            "ITL p50 / p99",
            "CPU ms per token: server + clients / offline",
        ),
    ]
    for c, entry in sorted(data["by_concurrency"].items(), key=lambda kv: int(kv[0])):
        s = entry["summary"]
        rounds = ", ".join(f"{r:.2f}" for r in s["ratios"])
        out.append(
            f"| {c} | {s['server_tok_s']:.1f} | {s['offline_tok_s']:.1f} | "
            f"**{s['ratio_median']:.2f}** ({rounds}) | {s['ttft_ms_p50']:.3g} / "
            f"{s['ttft_ms_p99']:.3g} ms | {s['itl_ms_p50']:.3g} / {s['itl_ms_p99']:.3g} ms | "
            f"{s['server_cpu_ms_per_token']:.1f} + {s['client_cpu_ms_per_token']:.1f} / "
            f"{s['offline_cpu_ms_per_token']:.1f} |"
        )
    return out


GPU_CHECK = "experiments/bench/results/gpu_check_h200_2026-12-04"
GPU_CHECK_COMMAND = (
    'run(command="bash scripts/gpu_check.sh", carry=[".gpu_bundle"]) (the device tool; '
    "scripts/README.md)"
)


@table("gpu_check", GPU_CHECK, GPU_CHECK_COMMAND)
def _gpu_check(folder: Path) -> list[str]:
    return gpu_check_summary.check_table(folder)


@table("gpu_decode", GPU_CHECK, GPU_CHECK_COMMAND)
def _gpu_decode(folder: Path) -> list[str]:
    return [
        f"{gpu_check_summary.environment(folder)}. Decode step of the default tiny model, "
        "bf16, median of 3 repeats, one run:",
        "",
        *gpu_check_summary.decode_rows(folder),
    ]


@table(
    "moe_bench",
    "experiments/bench/results/moe_bench_cpu.json",
    "python -m experiments.bench.moe --rounds 5 --threads 2 "
    "--out experiments/bench/results/moe_bench_cpu.json",
)
def _moe_bench(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    rows = data["rows"]
    o2 = {(r["dtype"], r["batch"]): r["median_ms"] for r in rows if r["contender"] == "O2"}
    out = [
        f"`{data['preset']}`, {data['threads']} threads{_on_cpu(data.get('machine'))}, load "
        f"average {data['load_average']['start'][0]:.2f} at the start.",
        "",
        *_head(
            "dtype",
            "batch",
            "contender",
            "decode median ms",
            "p90 ms",
            "O2 speed-up vs it",
            "token agreement",
        ),
    ]
    for r in rows:
        mine = o2.get((r["dtype"], r["batch"]))
        speedup = f"{r['median_ms'] / mine:.2f}x" if mine else "—"
        out.append(
            f"| {r['dtype']} | {r['batch']} | {r['contender']} | {r['median_ms']:.2f} | "
            f"{r['p90_ms']:.2f} | {speedup} | {r['token_agreement']:.2f} vs "
            f"{r['agreement_ref']} |"
        )
    out += [
        "",
        f"O2 batch 1 against its active-weight floor ({data['floor_ms']:.2f} ms: "
        f"{data['active_weight_bytes']['total'] / 1e6:.1f} MB at "
        f"{data['bandwidth_gb_s']:.1f} GB/s): {data['o2_b1_over_floor']:.2f}x.",
    ]
    return out


@table(
    "peers",
    "experiments/bench/results/peers",
    "python -m experiments.bench.peers --sizes S --batches B "
    "--out experiments/bench/results/peers/peers_<sizes>_<date>.json",
)
def _peers(folder: Path) -> list[str]:
    out: list[str] = []
    # Newest first: the names end in the run's date, peers_<sizes>_<YYYY-MM-DDTHHMM>.json.
    for path in sorted(folder.glob("*.json"), key=lambda p: p.stem.rsplit("_", 1)[-1])[::-1]:
        data = json.loads(path.read_text())
        st = data["settings"]
        floors = "; ".join(
            f"{size} {f['floor_ms']['bf16']:.2f} ms bf16 / {f['floor_ms']['q8_0']:.2f} ms q8_0 "
            f"at {f['best_gb_s']:.1f} GB/s ({'the probe' if f['probe_is_best'] else 'a contender'})"
            for size, f in data["floors"].items()
        )
        cpu = _on_cpu(data.get("machine"))
        out += [
            f"`{path.name}`: sizes {', '.join(st['sizes'])}, batches "
            f"{', '.join(map(str, st['batches']))}, {st['threads']} threads{cpu}, fresh process "
            f"per run; floors {floors}.",
            "",
            *_head(
                "size",
                "batch",
                "ratio",
                "baseline ms",
                "contender ms",
                "speed-up (of medians)",
                "per round: median [min, max]",
            ),
        ]
        # the ratio within each round, from the runs (files written before it was stored too)
        names = {x["contender"] for x in data["runs"]}
        pairs = {label: (b, c) for label, b, c in peer_summary.ratio_pairs(names)}
        for r in data["ratios"]:
            base, c = pairs.get(r["ratio"], (None, None))
            p = r.get("paired") or (
                peer_summary.paired(data["runs"], r["size"], base, c, r["batch"]) if base else None
            )
            out.append(
                f"| {r['size']} | {r['batch']} | {r['ratio']} | {r['baseline_ms']:.2f} | "
                f"{r['contender_ms']:.2f} | **{r['speedup']:.2f}x** | "
                f"{peer_summary.paired_cell(p)} |"
            )
        out += ["", *target_markdown(data["targets"]), ""]
    return out[:-1]


@table(
    "synthetic_models",
    "models/synthetic",
    "python -m experiments.synthetic.train (the commands below)",
)
def _synthetic_models(folder: Path) -> list[str]:
    out = [
        *_head(
            "folder",
            "model",
            "size",
            "training",
            "held-out exact match (O0)",
            "greedy acceptance by its target",
        ),
    ]
    for metrics in sorted(folder.glob("*/metrics.json")):
        m = json.loads(metrics.read_text())
        r, t, ev = m["recipe"], m["training"], m["eval"]
        size = (metrics.parent / "model.safetensors").stat().st_size / 1e6
        model = (
            f"Llama, {r['num_layers']} layer(s), hidden {r['hidden_size']}, {r['num_heads']} "
            f"heads, vocab {m['format']['vocab_size']}, {t['parameters'] / 1e3:.0f}k params"
        )
        training = (
            f"{t['steps']} steps × {r['batch_size']}, {t['train_seconds']:.0f} s on "
            f"{r['threads']} CPU thread(s)"
        )
        schemes = [k for k, v in ev.items() if isinstance(v, dict) and "exact_match" in v]
        exact = ", ".join(f"{ev[k]['exact_match']:.3f} {k}" for k in schemes) + f" (n={ev['n']})"
        draft = m.get("draft")
        accept = (
            ", ".join(
                f"{v['acceptance_rate']:.3f} at k = {k}" for k, v in sorted(draft["by_k"].items())
            )
            + f" (`{draft['target']}/`, n={draft['n']})"
            if draft
            else "—"
        )
        out.append(
            f"| `{metrics.parent.name}/` | {model} | {size:.1f} MB | {training} | {exact} "
            f"| {accept} |"
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
