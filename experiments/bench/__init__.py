"""The benchmarks (``python -m experiments.bench.<name>``), the contenders and peers they time,
the read-bandwidth floor, the targets they are held to (``targets``), the pytest-benchmark suite
of ``make bench`` (``pytest_suite/``, driven by ``python -m experiments.bench``) and the committed
results files the READMEs' tables are generated from (``results/``)."""

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Committed results files: the pytest-benchmark baseline, the benchmarks' JSON, the ablations."""
