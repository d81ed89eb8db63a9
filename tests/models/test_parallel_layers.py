"""ParallelLMHead's greedy call (models/parallel_layers.py) on one rank: the linear method's
greedy kernel where the method has one, None otherwise, re-checked when the method changes."""

from __future__ import annotations

import torch

from models.parallel_layers import ParallelLMHead


class _Plain:
    def apply(self, layer, x):
        return x @ layer.weight.t()


class _Greedy(_Plain):
    def __init__(self):
        self.calls = 0

    def apply_greedy(self, layer, x):
        self.calls += 1
        logits = self.apply(layer, x)
        top = logits.max(dim=-1)
        return logits, top.indices, top.values


def test_forward_greedy_follows_the_installed_method():
    head = ParallelLMHead(8, 16, dtype=torch.float32)
    torch.nn.init.normal_(head.weight)
    x = torch.randn(3, 8)
    assert head.forward_greedy(x) is None  # dense: no greedy kernel
    head.linear_method = _Plain()
    assert head.forward_greedy(x) is None
    greedy = head.linear_method = _Greedy()
    for _ in range(2):
        logits, idx, _ = head.forward_greedy(x)
        assert torch.equal(idx, (x @ head.weight.t()).argmax(-1))
    assert greedy.calls == 2
    head.linear_method = _Plain()  # replaced again: no stale greedy method
    assert head.forward_greedy(x) is None and greedy.calls == 2
