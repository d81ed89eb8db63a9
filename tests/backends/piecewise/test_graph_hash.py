"""backends/piecewise/split.py graph_hash: equal for the same graph in every process (the artifact
store deduplicates artifacts by it across processes), different for different graphs."""

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from backends.piecewise.split import graph_hash, stable_name

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import torch, torch.nn.functional as F
from backends.piecewise.split import graph_hash
def f(x, w):
    return torch.rsqrt(F.embedding(x, w).pow(2).mean(-1) + 1e-6)
gm = torch.fx.symbolic_trace(f)
print("HASH", graph_hash(gm, [torch.zeros(4, dtype=torch.long), torch.randn(10, 8)]))
"""


def _hash_in_fresh_process() -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return next(l for l in out.stdout.splitlines() if l.startswith("HASH")).split()[1]


def test_the_same_graph_hashes_equal_across_processes():
    # Python functions and torch builtins print with their address; the hash must not see it
    assert _hash_in_fresh_process() == _hash_in_fresh_process()


def test_targets_are_named_without_addresses():
    for target in (torch.rsqrt, F.embedding, torch.ops.aten.mm.default, "add", len):
        assert "0x" not in stable_name(target), target
    assert stable_name(torch.ops.aten.mm.default) == "aten.mm.default"


def test_different_graphs_hash_differently():
    x = [torch.randn(4, 8)]
    a = torch.fx.symbolic_trace(lambda t: torch.rsqrt(t))
    b = torch.fx.symbolic_trace(lambda t: torch.sqrt(t))
    assert graph_hash(a, x) != graph_hash(b, x)
    assert graph_hash(a, x) == graph_hash(torch.fx.symbolic_trace(lambda t: torch.rsqrt(t)), x)
