"""``model=addition`` (the embedded synthetic checkpoint and its tokenizer) and the engine
config group (``engine.enable_prefix_caching=true``) through the main Hydra job."""

from hydra_job_harness import run_job_in_process


def test_model_addition_answers_in_text(tmp_path, capsys):
    results = run_job_in_process(
        ["model=addition", "compile=O0", "workload.num_prompts=4", "check_agreement=false"],
        tmp_path / "job",
    )
    assert results["accuracy"] == {"exact_match": 1.0, "n": 4}
    assert {"prompt": "123+456=", "answer": "579"} in results["text_examples"]
    assert "'123+456=' -> '579'" in capsys.readouterr().out


def test_engine_group_reaches_the_llm(tmp_path):
    results = run_job_in_process(
        [
            "model.preset=test-llama",
            "workload.num_prompts=2",
            "workload.max_new_tokens=4",
            "compile=O0",
            "check_agreement=false",
            "engine.enable_prefix_caching=true",
            "engine.block_size=8",
        ],
        tmp_path / "job",
    )
    assert results["config"]["engine"]["enable_prefix_caching"] is True
    assert "prefix_cache_queried_tokens" in results["stats"]
    assert results["text_examples"] is None  # the random tiny model shows token ids
