"""The runner's input staging: what the forward sees (token ids, positions, slots, block
table, padding) after steps whose requests grow, change rows and shrink; decode defined once."""

from __future__ import annotations

import pytest
import torch

from framework.core.forward_context import (
    BatchDescriptor,
    CUDAGraphMode,
    get_forward_context,
    set_forward_context,
)
from framework.engine.kv_cache import NULL_BLOCK
from framework.engine.request import Request, ScheduledChunk, single_token_batch, step_kind
from framework.engine.runner import ModelRunner

BS = 4
NULL = NULL_BLOCK


class _Model(torch.nn.Module):
    def compute_logits(self, h):
        return h


def _runner(seen: list, pad_to=None):
    def forward(ids, pos):
        ctx = get_forward_context()
        md = next(iter(ctx.attn_metadata.values()))
        seen.append(
            {
                "ids": ids.tolist(),
                "pos": pos.tolist(),
                "slots": ctx.slot_mapping.tolist(),
                "mask": ctx.padding_mask.tolist(),
                "table": md.block_table.tolist(),
                "seq_lens": md.seq_lens.tolist(),
                "qsl": md.query_start_loc.tolist(),
            }
        )
        out = torch.zeros(ids.shape[0], 8)
        out[torch.arange(ids.shape[0]), ids % 8] = 1  # "sample" token id % 8
        return out

    def dispatch(n, num_reqs, uniform):
        return CUDAGraphMode.NONE, BatchDescriptor(pad_to or n, None, False)

    kv = {"l0": torch.zeros(2, 32, BS, 1, 8)}
    return ModelRunner(
        _Model(), forward, kv_caches=kv, block_size=BS, max_num_seqs=4, max_num_tokens=16,
        max_model_len=16, dispatch=dispatch,
    )  # fmt: skip


def _req(i, prompt, blocks, output=()):
    r = Request(i, list(prompt), 10)
    r.block_ids = list(blocks)
    r.output = list(output)
    return r


def test_cpu_buffers_are_the_staging_arrays():
    r = _runner([])
    for name in ("input_ids", "positions", "slot_mapping", "block_table", "padding_mask"):
        assert getattr(r, name).data_ptr() == r._np[name].ctypes.data, name


def test_staging_across_growth_row_changes_and_padding():
    seen: list = []
    r = _runner(seen, pad_to=None)
    a = _req(0, [1, 2, 3], [5])
    b = _req(1, [4, 5, 6, 7, 9], [7, 8])
    toks, _ = r.execute([ScheduledChunk(a, 0, 3), ScheduledChunk(b, 0, 5)])
    assert toks == [3 % 8, 9 % 8]
    s = seen[-1]
    assert s["ids"] == [1, 2, 3, 4, 5, 6, 7, 9] and s["pos"] == [0, 1, 2, 0, 1, 2, 3, 4]
    assert s["slots"] == [20, 21, 22, 28, 29, 30, 31, 32]
    assert s["table"] == [[5, NULL, NULL, NULL], [7, 8, NULL, NULL]]
    assert s["qsl"] == [0, 3, 8] and s["seq_lens"] == [3, 5]
    # decode: a grows into a new block (its list extended in place), b decodes in place
    a.output.append(11)
    a.block_ids.append(9)
    b.output.append(12)
    chunks = [ScheduledChunk(a, 3, 1), ScheduledChunk(b, 5, 1)]
    assert step_kind(chunks) == "decode" and single_token_batch(chunks)
    r.execute(chunks)
    s = seen[-1]
    assert s["ids"] == [11, 12] and s["pos"] == [3, 5] and s["slots"] == [23, 33]
    assert s["table"] == [[5, 9, NULL, NULL], [7, 8, NULL, NULL]]
    # row 0 now holds a different request (b moves up); a preempted request's new list
    c = _req(2, [1, 1, 1, 1, 1, 1, 1], [3, 4], output=[2])
    chunks = [ScheduledChunk(b, 6, 1), ScheduledChunk(c, 7, 1)]
    b.output.append(13)
    r.execute(chunks)
    s = seen[-1]
    assert s["table"] == [[7, 8, NULL, NULL], [3, 4, NULL, NULL]]
    assert s["ids"] == [13, 2] and s["slots"] == [8 * BS + 2, 4 * BS + 3]
    assert r.step_times["decode"] and r.step_times["prefill"]
    assert [t["num_decode"] for t in r.trace] == [0, 2, 2]


def test_padding_and_unrecorded_dummy_steps():
    seen: list = []
    r = _runner(seen, pad_to=8)
    a = _req(0, [1, 2, 3], [5])
    r.execute([ScheduledChunk(a, 0, 3)], record=False)
    s = seen[-1]
    assert s["ids"] == [1, 2, 3, 0, 0, 0, 0, 0] and s["slots"][3:] == [-1] * 5
    assert s["mask"] == [True] * 3 + [False] * 5
    assert r.trace == [] and not any(r.step_times.values())


def test_one_token_prompt_is_uniform_but_not_decode():
    a = _req(0, [5], [1])
    chunks = [ScheduledChunk(a, 0, 1)]
    assert single_token_batch(chunks) and not chunks[0].is_decode
    assert step_kind(chunks) == "prefill"
    assert ScheduledChunk(a, 1, 1).is_decode


def test_advance_matches_a_freshly_built_step():
    """``advance`` moves a single-token batch one position on in place (ids from a tensor,
    positions, slots across a block boundary, seq_lens, padding kept): the forward sees what
    a context built from scratch for the next step gives it."""
    seen: list = []
    r = _runner(seen, pad_to=4)
    a = _req(0, [1, 2, 3], [5, 6])  # position 3 is the last of block 5; 4 is in block 6
    b = _req(1, [4, 5], [7])
    ctx, n, n_pad = r.build_context([ScheduledChunk(a, 2, 1), ScheduledChunk(b, 1, 1)])
    assert (n, n_pad) == (2, 4)
    ids, pos = r.inputs_of(ctx)
    for step, nxt in enumerate(([9, 8], [3, 2])):
        ctx = r.advance(ctx, torch.tensor(nxt))
        with set_forward_context(ctx):
            r.forward(ids, pos)
        got = seen[-1]
        a.output.append(nxt[0]), b.output.append(nxt[1])
        fresh: list = []
        f = _runner(fresh, pad_to=4)
        fctx, _, _ = f.build_context(
            [ScheduledChunk(a, 3 + step, 1), ScheduledChunk(b, 2 + step, 1)]
        )
        with set_forward_context(fctx):
            f.forward(*f.inputs_of(fctx))
        assert got == fresh[-1], step
        md = ctx.attn_metadata["l0"]
        assert md.seq_lens_cpu == [4 + step, 3 + step] and md.max_seq_len == 4 + step
    assert got["slots"][:2] == [6 * BS + 0, 7 * BS + 3] and got["mask"] == [True] * 2 + [False] * 2


def test_advance_refuses_multi_token_steps_and_missing_blocks():
    r = _runner([])
    a = _req(0, [1, 2, 3], [5])
    ctx, _, _ = r.build_context([ScheduledChunk(a, 0, 3)])
    with pytest.raises(ValueError, match="single-token"):
        r.advance(ctx, torch.tensor([1]))
    ctx, _, _ = r.build_context([ScheduledChunk(a, 2, 1)])
    ctx = r.advance(ctx, torch.tensor([1]))  # position 3: still block 5
    with pytest.raises(ValueError, match="no KV block"):
        r.advance(ctx, torch.tensor([1]))  # position 4: no block reserved


class _GreedyModel(_Model):
    """compute_logits_greedy as a fused head would give it: the logits and, per row, an
    index and value -- here deliberately NOT the logits' argmax (column 7, or a NaN for
    request 1), so a test can tell which path chose the tokens; None when ``fuse`` is off."""

    def __init__(self) -> None:
        super().__init__()
        self.fuse, self.fused_calls = True, 0

    def compute_logits_greedy(self, h):
        if not self.fuse:
            return None
        self.fused_calls += 1
        idx = torch.full((h.shape[0],), 7, dtype=torch.int64)
        val = torch.ones(h.shape[0])
        if h.shape[0] > 1:
            val[1] = float("nan")
        return h, idx, val


def _greedy_runner(model) -> ModelRunner:
    def forward(ids, pos):
        out = torch.zeros(ids.shape[0], 8)
        out[torch.arange(ids.shape[0]), ids % 8] = 1
        return out

    def dispatch(n, num_reqs, uniform):
        return CUDAGraphMode.NONE, BatchDescriptor(n, None, False)

    return ModelRunner(
        model, forward, kv_caches={"l0": torch.zeros(2, 32, BS, 1, 8)}, block_size=BS,
        max_num_seqs=4, max_num_tokens=16, max_model_len=16, dispatch=dispatch,
    )  # fmt: skip


def test_greedy_steps_take_their_tokens_from_a_fused_head_when_it_has_one():
    """A step whose requests are all greedy (no penalties, no logprobs) takes each token from
    the model's compute_logits_greedy (a non-finite maximum fails its request alone); a
    request asking for logprobs, the switch off, or a head that returns None send the step
    to compute_logits and the sampler; a model without the method never takes that path."""
    from framework.engine.request import SamplingParams

    model = _GreedyModel()
    r = _greedy_runner(model)
    assert r.greedy_logits is not None and r.fuse_greedy_head
    a, b = _req(0, [1, 2, 3], [5]), _req(1, [4, 5], [7])
    toks, logits = r.execute([ScheduledChunk(a, 0, 3), ScheduledChunk(b, 0, 2)])
    assert toks == [7, None] and model.fused_calls == 1 and logits.shape == (2, 8)
    assert b.finished and not a.finished  # the NaN row fails its request alone
    c = _req(2, [1, 2, 3], [6])
    c.params = SamplingParams(logprobs=1)
    toks, _ = r.execute([ScheduledChunk(c, 0, 3)])
    assert toks == [3] and model.fused_calls == 1  # logprobs: the sampler's path
    d = _req(3, [1, 2, 3], [8])
    r.fuse_greedy_head = False
    assert r.execute([ScheduledChunk(d, 0, 3)])[0] == [3] and model.fused_calls == 1
    r.fuse_greedy_head, model.fuse = True, False
    assert r.execute([ScheduledChunk(d, 0, 3)])[0] == [3]  # None from the head: sampler
    assert _runner([]).greedy_logits is None  # _Model has no fused head
