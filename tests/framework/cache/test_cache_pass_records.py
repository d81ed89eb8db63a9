"""Pass records say why a pass did not run (artifact loaded / Inductor cache hit) and count
matches per piece instance (per layer), with the per-unique-graph count beside."""

from checkpoints import build_family_checkpoint

from framework import LLM, CompilationConfig

LAYERS = 4


def _build(path, cache_dir, **kw):
    return LLM(
        str(path),
        max_model_len=64,
        optimization_level=2,
        compilation_config=CompilationConfig(progress_bar=False, cache_dir=str(cache_dir), **kw),
    )


def test_records_per_instance_and_why_not_run(tmp_path):
    ckpt = build_family_checkpoint(tmp_path / "llama4", "llama", num_hidden_layers=LAYERS)
    cold = _build(ckpt, tmp_path / "a")
    pieces = cold.stats["compile_num_pieces"]
    warm = _build(ckpt, tmp_path / "a")  # artifact cache hit: nothing compiles
    assert warm.stats["compile_loads"] > 0
    for name, rec in warm.stats["passes"].items():
        assert rec["status"] == "not run: artifact loaded", name
        assert rec["total_matches"] == 0 and rec["pieces"] == []
        assert len(rec["instances"]) == pieces
    # New artifact cache, same code: Inductor's FX-graph cache (filled by `cold`) answers.
    inductor_hit = _build(ckpt, tmp_path / "b")
    assert inductor_hit.stats["compile_compiles"] > 0
    for name, rec in inductor_hit.stats["passes"].items():
        assert rec["status"] == "not run: Inductor cache hit", name

    # Passes forced to run (dumping): identical layers compile once, matches count per layer.
    ran = _build(ckpt, tmp_path / "c", debug_dump_path=str(tmp_path / "dump"))
    rec = ran.stats["passes"]["prepack_linear"]
    assert rec["status"] == "ran"
    assert rec["total_matches"] == 4 * LAYERS  # qkv, o, gate_up, down in every layer
    assert rec["unique_graph_matches"] < rec["total_matches"]
    assert len(rec["pieces"]) == ran.stats["compile_unique_graphs"] < pieces
    shared = [i for i in rec["instances"] if i["shared_with"]]
    assert shared and all(i["matches"] == 4 for i in shared)  # one layer's linears each


def test_recorded_pass_order_is_the_order_they_ran(llama_checkpoint, compile_cache_dir):
    llm = LLM(
        str(llama_checkpoint),
        max_model_len=64,
        optimization_level=2,
        compilation_config=CompilationConfig(
            progress_bar=False,
            cache_dir=compile_cache_dir,
            pass_config={"passes": ["fix_functionalization", "prepack_linear", "noop_elimination"]},
        ),
    )
    ran_order = list(llm.stats["passes"])
    assert ran_order == ["noop_elimination", "prepack_linear", "fix_functionalization"]
    assert llm.config.pass_config.passes == ran_order
    assert llm.config.to_dict()["pass_config"]["passes"] == ran_order
