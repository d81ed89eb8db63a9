from experiments.bench.prefix_cache import main, run
from models.tiny import ensure_tiny_model


def test_shared_prefix_benchmark_hits_and_keeps_tokens(capsys):
    model = str(ensure_tiny_model(preset="test-llama"))
    r = run(model, prompts=4, prefix=64, suffix=8, repeats=1, max_num_batched_tokens=80)
    assert r["same_tokens"]
    assert r["hit_tokens"]["no_caching"] == 0
    assert r["hit_tokens"]["caching_warm"] == 4 * 64
    assert 0 < r["hit_tokens"]["caching_cold"] < 4 * 64  # the first prompt computes it
    assert set(r["prefill_ms"]) == {"no_caching", "caching_cold", "caching_warm"}
    assert (
        main(
            [
                "--model",
                model,
                "--prompts",
                "2",
                "--prefix",
                "32",
                "--suffix",
                "4",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    assert "same tokens: yes" in capsys.readouterr().out
