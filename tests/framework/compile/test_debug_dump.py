"""debug_dump_path: split graph, each piece's code, per-pass snapshots, decompiled bytecode."""

from framework import LLM, CompilationConfig


def test_debug_dump_writes_graphs_passes_and_bytecode(llama_checkpoint, tmp_path):
    dump = tmp_path / "dump"
    llm = LLM(
        str(llama_checkpoint),
        max_model_len=64,
        compilation_config=CompilationConfig(
            level=1, compiler="eager", debug_dump_path=str(dump), progress_bar=False
        ),
    )
    names = {p.name for p in dump.iterdir()}
    assert {"split_graph.py", "binding.json"} <= names
    pieces = sorted(n for n in names if n.startswith("submod_"))
    assert len(pieces) == llm.stats["compile_unique_graphs"]
    assert "piecewise.attention" in (dump / "split_graph.py").read_text()
    snapshots = list((dump / "passes").rglob("*_after_prepack_linear.txt"))
    assert snapshots and "packed_linear" in snapshots[0].read_text()
    assert any(p.suffix == ".py" for p in (dump / "depyf").iterdir())


def test_debug_dump_with_inductor_at_O2_has_every_piece_before_and_after_each_pass(
    tiny_checkpoint, tmp_path
):
    """Plain O2 (the Inductor adaptor, artifact cache on): every piece gets its graph before
    the passes and after each pass, in run order; artifacts are still saved and load."""
    from checkpoints import build_family_checkpoint

    ckpt = build_family_checkpoint(tmp_path / "llama3", "llama", num_hidden_layers=3)
    dump, cache = tmp_path / "dump", str(tmp_path / "cache")
    llm = LLM(
        str(ckpt),
        max_model_len=64,
        optimization_level=2,
        compilation_config=CompilationConfig(
            debug_dump_path=str(dump), cache_dir=cache, progress_bar=False
        ),
    )
    order = llm.config.pass_config.passes
    expected = ["00_before_passes.txt"] + [
        f"{i:02d}_after_{n}.txt" for i, n in enumerate(order, start=1)
    ]
    pieces = sorted(p.stem for p in dump.glob("submod_*.py"))
    assert len(pieces) == llm.stats["compile_num_pieces"] == 4  # 3 attentions
    for piece in pieces:
        (rng_dir,) = (dump / "passes" / piece).iterdir()
        files = sorted(p.name for p in rng_dir.iterdir())
        if files == ["same_graph_as.txt"]:  # identical layers compile once
            original = (rng_dir / "same_graph_as.txt").read_text().strip()
            assert original in pieces and original != piece
            continue
        assert files == expected, piece
    after = next((dump / "passes").rglob("*_after_prepack_linear.txt")).read_text()
    assert "packed_linear" in after
    assert llm.stats["cache_writes"] > 0  # the artifacts were saved (no "no artifact to save")
    warm = LLM(
        str(ckpt),
        max_model_len=64,
        optimization_level=2,
        compilation_config=CompilationConfig(cache_dir=cache, progress_bar=False),
    )
    assert warm.stats["compile_loads"] > 0 and warm.stats["compile_compiles"] == 0
    assert warm.generate([[1, 2, 3]], 3) == llm.generate([[1, 2, 3]], 3)
