"""debug_dump_path: split graph, each piece's code, per-pass snapshots, decompiled bytecode."""
from framework import LLM, CompilationConfig


def test_debug_dump_writes_graphs_passes_and_bytecode(llama_checkpoint, tmp_path):
    dump = tmp_path / "dump"
    llm = LLM(str(llama_checkpoint), max_model_len=64, compilation_config=CompilationConfig(
        level=1, backend="eager", debug_dump_path=str(dump), progress_bar=False))
    names = {p.name for p in dump.iterdir()}
    assert {"split_graph.py", "binding.json"} <= names
    pieces = sorted(n for n in names if n.startswith("submod_"))
    assert len(pieces) == llm.stats["compile_unique_graphs"]
    assert "piecewise.attention" in (dump / "split_graph.py").read_text()
    snapshots = list((dump / "passes").rglob("*_after_prepack_linear.txt"))
    assert snapshots and "prepacked_linear" in snapshots[0].read_text()
    assert any(p.suffix == ".py" for p in (dump / "depyf").iterdir())
