"""Scaffold a new pass: ``python -m passes.scaffold NAME [--out DIR]``.

Writes ``DIR/__init__.py`` when ``DIR`` is not the current folder and has none (so ``DIR`` is
a package, as in the tutorial's ``mylab/``), ``DIR/NAME.py`` (a plain-function pass that
already works: it removes multiplications by one, ``x * 1 -> x``, and returns its match
count) and ``DIR/test_NAME.py`` (builds a small FX graph, runs the pass through the pass
manager, checks the rewrite, the count and that the graph computes the same values). Edit the
pattern, keep the test honest, then run it with
``python -m experiments.run 'passes=[+<module>:NAME]'`` (passes/README.md, tutorial).
Existing files are never overwritten.
"""

from __future__ import annotations

import argparse
import keyword
import sys
from pathlib import Path
from typing import Optional, Sequence

PASS_TEMPLATE = '''"""{name}: a pass over post-grad FX graphs (aten ops), as a plain function.

Run it:  python -m experiments.run 'passes=[+{module}:{name}]'
Before:  y = aten.mul.Tensor(x, 1)
After:   y is x (the multiplication is gone)
"""

import torch

aten = torch.ops.aten


def {name}(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` in place; return how many places matched (the pass manager records
    it per piece; return nothing and the record says "not reported")."""
    matches = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.mul.Tensor:
            continue
        x, other = node.args[0], node.args[1]
        if isinstance(other, (int, float)) and other == 1 and isinstance(x, torch.fx.Node):
            if x.meta.get("val") is not None and node.meta.get("val") is not None:
                if x.meta["val"].dtype != node.meta["val"].dtype:
                    continue  # x * 1 may change the dtype: not a no-op then
            node.replace_all_uses_with(x)
            graph.erase_node(node)
            matches += 1
    return matches
'''

TEST_TEMPLATE = '''"""Tests of the {name} pass (written by python -m passes.scaffold)."""

import torch

from framework.core.config import PassConfig
from passes.manager import PassManager
from passes.registry import resolve_pass

aten = torch.ops.aten
PASS = "{module}:{name}"


def _graph_module():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(aten.mul.Tensor, (x, 1))
    g.output(g.call_function(aten.relu.default, (y,)))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_{name}_rewrites_counts_and_keeps_values():
    gm = _graph_module()
    x = torch.randn(4, 8)
    expected = gm(x)
    manager = PassManager(PassConfig(passes=[PASS]))
    manager.run_on_graph_module(gm)
    assert not any(n.target is aten.mul.Tensor for n in gm.graph.nodes)
    assert manager.stats()[PASS]["total_matches"] == 1
    torch.testing.assert_close(gm(x), expected)


def test_{name}_leaves_other_graphs_alone():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(aten.mul.Tensor, (x, 2)))
    assert resolve_pass(PASS)()(g) is None  # the wrapper records the count itself
    assert sum(n.target is aten.mul.Tensor for n in g.nodes) == 1
'''


def module_name_for(out: Path, name: str) -> str:
    """The import path of ``out/name.py``: the dotted package path up to the first folder
    without ``__init__.py``."""
    parts = [name]
    folder = out.resolve()
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


def _import_root(out: Path) -> Path:
    """The folder that must be on ``sys.path`` for :func:`module_name_for`'s path to import."""
    folder = out.resolve()
    while (folder / "__init__.py").is_file():
        folder = folder.parent
    return folder


def scaffold(name: str, out: Path) -> tuple[Path, Path]:
    """Write the pass and its test (and ``out/__init__.py``, see the module docstring);
    returns the pass's and the test's paths."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"passes.scaffold: {name!r} is not a valid Python identifier")
    if out.resolve() != Path.cwd().resolve() and not out.name.isidentifier():
        raise ValueError(
            f"passes.scaffold: --out {out} cannot be a package (its name {out.name!r} is not a "
            f"Python identifier); choose a folder such as mylab"
        )
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != Path.cwd().resolve() and not (out / "__init__.py").exists():
        (out / "__init__.py").write_text("")
    module = module_name_for(out, name)
    pass_file, test_file = out / f"{name}.py", out / f"test_{name}.py"
    for path in (pass_file, test_file):
        if path.exists():
            raise FileExistsError(f"passes.scaffold: {path} exists; not overwriting it")
    pass_file.write_text(PASS_TEMPLATE.format(name=name, module=module))
    test_file.write_text(TEST_TEMPLATE.format(name=name, module=module))
    return pass_file, test_file


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m passes.scaffold", description=__doc__.split("\n")[0]
    )
    parser.add_argument("name", help="the pass's function name (a Python identifier)")
    parser.add_argument("--out", default=".", help="folder for NAME.py and test_NAME.py")
    args = parser.parse_args(argv)
    try:
        pass_file, test_file = scaffold(args.name, Path(args.out))
    except (ValueError, FileExistsError) as e:
        print(e, file=sys.stderr)
        return 2
    module = module_name_for(Path(args.out), args.name)
    root = _import_root(Path(args.out))
    print(f"wrote {pass_file} and {test_file}")
    print(f"import path: {module}:{args.name} (with {root} on PYTHONPATH)")
    print(f"test it:  PYTHONPATH={root}:$PYTHONPATH python -m pytest {test_file}")
    print(
        f"run it:   PYTHONPATH={root}:$PYTHONPATH python -m experiments.run "
        f"'passes=[+{module}:{args.name}]'"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
