"""The synthetic tasks, their scorer, and the shipped addition checkpoint run through our LLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from experiments.synthetic.task import (
    EOS_ID,
    SYMBOLS,
    VOCAB_SIZE,
    decode,
    encode,
    evaluate,
    exact_match,
    generate,
    get_task,
    is_held_out,
    main,
    read_task_name,
    task_names,
    token_agreement,
)

ROOT = Path(__file__).resolve().parents[3]
ADDITION = ROOT / "models" / "synthetic" / "addition"
QUANT_SHORTHANDS = ("int8_per_token", "int8_per_channel_weight_only")


def _little_endian(text: str) -> int:
    return int(text[::-1])


# --- vocabulary and tasks -------------------------------------------------------------------


def test_encode_decode_round_trip_and_errors():
    assert encode("12+3=") == [1, 2, 10, 3, 11]
    assert decode(encode("0123456789+=") + [EOS_ID]) == SYMBOLS + "$"
    assert EOS_ID < VOCAB_SIZE
    with pytest.raises(ValueError, match="'x'.*not in the synthetic vocabulary"):
        encode("1x2")


def test_addition_sequences_hold_the_sum_little_endian():
    task = get_task("addition")
    keys = torch.tensor([0, 123456, 999999, 500500, 1])
    seqs = task.sequences(keys)
    assert seqs.shape == (5, task.seq_len) and task.seq_len == 13
    for key, seq in zip(keys.tolist(), seqs.tolist()):
        text = decode(seq)
        a, b = divmod(key, 1000)
        assert text[3] == "+" and text[7] == "=" and text[-1] == "$"
        assert _little_endian(text[:3]) == a and _little_endian(text[4:7]) == b
        assert _little_endian(text[8:12]) == a + b
    assert decode(seqs[1].tolist()) == "321+654=9750$"  # 123 + 456 = 0579
    prompts, answers = task.split(seqs)
    assert all(len(p) == task.prompt_len for p in prompts)
    assert answers[2] == encode("8991") + [EOS_ID]  # 999 + 999 = 1998


def test_reversal_sequences():
    task = get_task("reversal")
    assert decode(task.sequences(torch.tensor([12345]))[0].tolist()) == "012345=543210$"


def test_task_registry_and_key_range():
    assert {"addition", "reversal"} <= set(task_names())
    with pytest.raises(ValueError, match="unknown synthetic task 'nope'"):
        get_task("nope")
    with pytest.raises(ValueError, match=r"keys must lie in \[0, 1000000\)"):
        get_task("addition").sequences(torch.tensor([10**6]))


def test_held_out_split_is_one_in_sixteen_and_never_trained_on():
    task = get_task("addition")
    frac = is_held_out(torch.arange(task.num_keys)).float().mean().item()
    assert abs(frac - 1 / 16) < 1e-3
    g = torch.Generator().manual_seed(0)
    train = task.sample_keys(5000, g, "train")
    test = task.sample_keys(500, g, "test")
    assert len(train) == 5000 and not is_held_out(train).any()
    assert len(test) == 500 and is_held_out(test).all()
    with pytest.raises(ValueError, match="split must be"):
        task.sample_keys(1, g, "val")


def test_held_out_keys_are_distinct_deterministic_and_prefix_stable():
    task = get_task("addition")
    k200 = task.held_out_keys(200, seed=7)
    assert len(set(k200.tolist())) == 200
    assert torch.equal(k200, task.held_out_keys(200, seed=7))
    assert torch.equal(task.held_out_keys(50, seed=7), k200[:50])
    assert not torch.equal(task.held_out_keys(50, seed=8), k200[:50])


def test_exact_match_needs_the_whole_answer_and_the_stop():
    answers = [[1, 2, EOS_ID], [3, 4, EOS_ID]]
    assert exact_match([[1, 2, EOS_ID], [3, 4, EOS_ID]], answers) == 1.0
    assert exact_match([[1, 2, EOS_ID], [3, 5, EOS_ID]], answers) == 0.5
    assert exact_match([[1, 2], [3, 4, 4]], answers) == 0.0  # never stopped
    with pytest.raises(ValueError, match="2 outputs for 1 answers"):
        exact_match(answers, answers[:1])


def test_token_agreement_counts_the_common_prefix_over_the_longer_output():
    assert token_agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    assert token_agreement([[1, 9, 3]], [[1, 2, 3]]) == pytest.approx(1 / 3)  # diverged at 2nd
    assert token_agreement([[1, 2]], [[1, 2, 3, 4]]) == pytest.approx(2 / 4)
    with pytest.raises(ValueError):
        token_agreement([[1]], [[1], [2]])


# --- the shipped checkpoint -----------------------------------------------------------------


def _metrics() -> dict:
    return json.loads((ADDITION / "metrics.json").read_text())


def test_shipped_checkpoint_files_and_config():
    names = {p.name for p in ADDITION.iterdir()}
    assert {"config.json", "model.safetensors", "metrics.json"} <= names
    assert sum(p.stat().st_size for p in ADDITION.iterdir()) <= 10 * 2**20
    config = json.loads((ADDITION / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["eos_token_id"] == EOS_ID and config["vocab_size"] == VOCAB_SIZE
    m = _metrics()
    assert read_task_name(ADDITION) == m["task"] == "addition"
    assert m["eval"]["unquantized"]["exact_match"] >= 0.9  # the metric means something


def test_shipped_checkpoint_loads_through_our_loader():
    from models.loader import load_model

    model, config = load_model(ADDITION, torch.float32)
    assert config.architecture == "LlamaForCausalLM" and config.eos_token_ids == [EOS_ID]
    assert config.vocab_size == VOCAB_SIZE
    assert sum(p.numel() for p in model.parameters()) == _metrics()["training"]["parameters"]


def test_our_llm_matches_transformers_on_the_shipped_checkpoint():
    """Same greedy answers and first-token logits as transformers' own model."""
    from transformers import LlamaForCausalLM

    task = get_task("addition")
    seqs = task.sequences(task.held_out_keys(16, seed=3))
    prompts, _ = task.split(seqs)
    ours = generate(ADDITION, prompts, task.answer_len + 1)
    hf = LlamaForCausalLM.from_pretrained(ADDITION, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor(prompts),
            max_new_tokens=task.answer_len + 1,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=EOS_ID,
        )
        hf_logits = hf(torch.tensor(prompts)).logits[:, -1]
    hf_new = [row[task.prompt_len :] for row in hf_out.tolist()]
    assert ours.outputs == hf_new
    torch.testing.assert_close(ours.first_token_logits, hf_logits, atol=1e-4, rtol=1e-4)


def test_o0_exact_match_reproduces_the_recorded_accuracy():
    rec = _metrics()["eval"]
    n = rec["smoke_n"]
    res = evaluate(ADDITION, n=n, seed=rec["seed"])
    assert res["n"] == n and res["quantized_layers"] == 0
    # One example of slack: float sums may differ across CPUs (different SIMD widths).
    assert abs(res["exact_match"] - rec["unquantized"]["exact_match_first_smoke_n"]) <= 1 / n
    assert res["exact_match"] >= 0.9
    assert res["token_agreement_vs"]["unquantized_O0"] == 1.0


def test_the_metric_detects_a_damaged_model(tmp_path):
    """Swapping the embeddings of digits 3 and 7 makes the model misread them: exact match
    must collapse (the score is not insensitive to the weights)."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "addition"
    shutil.copytree(ADDITION, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    emb = tensors["model.embed_tokens.weight"]
    emb[[3, 7]] = emb[[7, 3]].clone()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    assert evaluate(bad, n=50, seed=_metrics()["eval"]["seed"])["exact_match"] < 0.7


@pytest.mark.parametrize("shorthand", QUANT_SHORTHANDS)
def test_quantized_exact_match_within_two_points(shorthand):
    rec = _metrics()["eval"]
    n, seed = rec["smoke_n"], rec["seed"]
    base = evaluate(ADDITION, n=n, seed=seed)
    res = evaluate(ADDITION, quantization=shorthand, n=n, seed=seed, reference=base)
    assert res["quantized_layers"] > 0
    assert res["max_logit_diff_vs"]["unquantized_O0"] > 0  # the weights really changed
    assert res["exact_match"] >= base["exact_match"] - 0.02 - 1e-9
    assert res["token_agreement_vs"]["unquantized_O0"] >= 0.98


def test_evaluate_rejects_a_reference_for_other_prompts():
    base = evaluate(ADDITION, n=8, seed=1)
    with pytest.raises(ValueError, match="reference was computed for another"):
        evaluate(ADDITION, quantization="int8_per_token", n=8, seed=2, reference=base)


def test_cli_prints_json(capsys):
    assert main([str(ADDITION), "-n", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["task"] == "addition" and out["n"] == 8 and 0.0 <= out["exact_match"] <= 1.0
    assert "outputs" not in out


def test_compiled_o2_keeps_the_accuracy(tmp_path):
    """The piecewise-compiled model (O2, Inductor) answers like the eager one."""
    rec = _metrics()["eval"]
    n, seed = rec["smoke_n"], rec["seed"]
    base = evaluate(ADDITION, n=n, seed=seed)
    res = evaluate(
        ADDITION,
        optimization_level=2,
        n=n,
        seed=seed,
        reference=base,
        cache_dir=str(tmp_path / "cache"),
    )
    assert res["exact_match"] >= base["exact_match"] - 1 / n
    assert res["token_agreement_vs"]["unquantized_O0"] >= 0.98


# --- the larger target (models/synthetic/addition-large) ------------------------------------

ADDITION_LARGE = ROOT / "models" / "synthetic" / "addition-large"


def test_large_target_is_a_deeper_model_of_the_same_task_and_vocabulary():
    """The draft-worthy target: same task, tokenizer and vocabulary as ``addition/`` and its
    draft, four times the layers of ``addition/``; its recorded accuracy means something."""
    m = json.loads((ADDITION_LARGE / "metrics.json").read_text())
    small = _metrics()
    assert m["task"] == small["task"] == "addition" and m["format"] == small["format"]
    config = json.loads((ADDITION_LARGE / "config.json").read_text())
    assert config["vocab_size"] == VOCAB_SIZE and config["eos_token_id"] == EOS_ID
    assert config["num_hidden_layers"] == m["recipe"]["num_layers"] == 8
    assert m["eval"]["unquantized"]["exact_match"] >= 0.99
    assert (ADDITION_LARGE / "tokenizer.json").is_file()


def test_large_target_reproduces_its_recorded_accuracy():
    rec = json.loads((ADDITION_LARGE / "metrics.json").read_text())["eval"]
    n = rec["smoke_n"]
    res = evaluate(ADDITION_LARGE, n=n, seed=rec["seed"])
    assert abs(res["exact_match"] - rec["unquantized"]["exact_match_first_smoke_n"]) <= 1 / n
