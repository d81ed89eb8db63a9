"""Training a synthetic-task model: deterministic, and saved as a loadable HF checkpoint."""

from __future__ import annotations

import json
import math

import torch

from experiments.synthetic.task import EOS_ID, VOCAB_SIZE, get_task
from experiments.synthetic.train import (
    TrainRecipe,
    _lr_at,
    answer_loss,
    greedy_exact_match,
    save,
    train,
)

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    batch_size=16,
    max_steps=6,
    warmup_steps=2,
    eval_every=3,
    val_size=32,
    lr=1e-2,
)


def _quiet(*_):
    pass


def test_training_is_deterministic_and_lowers_the_loss():
    recipe = TrainRecipe(**TINY)
    threads = torch.get_num_threads()
    model_a, rec_a = train(recipe, log=_quiet)
    assert torch.get_num_threads() == threads  # process settings restored
    assert not torch.are_deterministic_algorithms_enabled()
    model_b, rec_b = train(recipe, log=_quiet)
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert rec_a["curve"] == rec_b["curve"] and rec_a["steps"] == 6
    # an untrained model scores ~ln(16) = 2.77 (uniform over the vocabulary)
    assert rec_a["curve"][-1]["loss"] < math.log(VOCAB_SIZE) - 0.3


def test_loss_only_scores_the_answer():
    task = get_task("addition")
    recipe = TrainRecipe(**TINY)
    model, _ = train(TrainRecipe(**{**TINY, "max_steps": 1}), log=_quiet)
    seqs = task.sequences(torch.tensor([123456, 1]))
    changed = seqs.clone()
    changed[:, task.prompt_len :] = 0  # different answers -> different loss
    with torch.no_grad():
        assert answer_loss(model, seqs, task.prompt_len) != answer_loss(
            model, changed, task.prompt_len
        )
    assert 0.0 <= greedy_exact_match(model, seqs, task.prompt_len) <= 1.0
    assert _lr_at(0, recipe) < _lr_at(recipe.warmup_steps, recipe) == recipe.lr
    assert _lr_at(recipe.max_steps, recipe) == 0.1 * recipe.lr


def test_save_writes_a_checkpoint_our_llm_runs(tmp_path):
    recipe = TrainRecipe(**TINY)
    model, record = train(recipe, log=_quiet)
    out = save(model, record, recipe, tmp_path / "addition", log=_quiet, eval_n=8)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp dir renamed
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == EOS_ID and config["architectures"] == ["LlamaForCausalLM"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "addition" and metrics["recipe"]["hidden_size"] == 32
    assert metrics["eval"]["n"] == 8
    assert 0.0 <= metrics["eval"]["unquantized"]["exact_match"] <= 1.0
