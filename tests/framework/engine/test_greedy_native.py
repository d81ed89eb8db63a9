"""The native greedy argmax (framework/engine/greedy_native.py) against numpy's argmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from framework.engine import greedy_native
from framework.engine.sampler import greedy_argmax


def reference(x: torch.Tensor) -> tuple[list[int], list[float]]:
    rows = x.float().numpy()
    idx = rows.argmax(axis=-1)
    return idx.tolist(), rows[np.arange(rows.shape[0]), idx].tolist()


def same(a: list[float], b: list[float]) -> bool:
    return all((p != p and q != q) or p == q for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("portable", [None, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_maximum_ties_infinities_nans_and_tails(portable, dtype):
    """Widths around the 16-lane chunks and the 64-column groups of the AVX-512 pass; ties
    (the first index wins), +inf, rows of -inf and a NaN anywhere (its first index)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(240):
        rows = 1 + trial % 9
        n = [1, 5, 15, 16, 17, 63, 64, 65, 100, 129, 257][trial % 11]
        x = torch.randn(rows, n, generator=g)
        if trial % 3 == 0:
            x = torch.round(x)  # many ties
        if trial % 4 == 0:
            x[0, int(torch.randint(n, (1,), generator=g))] = float("nan")
            x[0, -1] = float("nan")
        if trial % 5 == 0:
            x[-1] = float("-inf")
        if trial % 7 == 0:
            x[rows // 2, int(torch.randint(n, (1,), generator=g))] = float("inf")
        x = x.to(dtype)
        got = greedy_native.greedy_argmax(x, portable)
        assert got is not None
        want = reference(x)
        assert got[0] == want[0], (trial, rows, n)
        assert same(got[1], want[1]), (trial, rows, n)


def test_threads_and_a_row_strided_view():
    """Enough rows for the threads, read through a view whose rows are not adjacent."""
    g = torch.Generator().manual_seed(1)
    big = (torch.randn(64, 40000, generator=g) * 3).bfloat16()
    view = big[::2, 1000:33000]
    assert not view.is_contiguous()
    got = greedy_native.greedy_argmax(view)
    assert got is not None and got[0] == reference(view)[0]
    assert greedy_argmax(view)[0] == reference(view)[0]


def test_what_it_does_not_take_falls_back():
    x = torch.randn(3, 50)
    assert greedy_native.greedy_argmax(x.half()) is None  # another dtype
    assert greedy_native.greedy_argmax(x.t()) is None  # columns not adjacent
    assert greedy_native.greedy_argmax(x[0]) is None  # not a matrix
    # and the sampler's own path still answers for them
    assert greedy_argmax(x.half())[0] == reference(x.half())[0]
    assert greedy_argmax(x.t().contiguous().t())[0] == reference(x)[0]


def test_a_bf16_engine_takes_greedy_tokens_from_its_head_with_the_same_tokens(
    llama_checkpoint, compile_cache_dir
):
    """O2 in bf16 packs the LM head for the small-M kernel: greedy steps take their tokens
    from its fused greedy epilogue (every step here), and the tokens equal the head-then-
    sampler path's, batched prompts of different lengths; a logprobs request still samples."""
    from framework import LLM
    from framework.engine.request import SamplingParams
    from passes import native_ops

    if not native_ops.load():
        pytest.skip("the C++ op library does not build here")
    llm = LLM(
        str(llama_checkpoint), dtype="bfloat16", optimization_level=2, max_num_seqs=4,
        max_model_len=64, cache_dir=compile_cache_dir,
    )  # fmt: skip
    runner = llm.runner
    head = runner.greedy_logits
    fused: list[bool] = []

    def counted(h):
        got = head(h)
        fused.append(got is not None)
        return got

    runner.greedy_logits = counted
    prompts = [[5, 6, 7, 8, 9], [3], [11, 12, 13]]
    on = llm.generate(prompts, 12, ignore_eos=True)
    assert fused and all(fused) and len(fused) == 12  # prefill + 11 decode steps, one batch
    runner.fuse_greedy_head = False
    assert llm.generate(prompts, 12, ignore_eos=True) == on
    runner.fuse_greedy_head = True
    n = len(fused)
    sp = SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True)
    out = llm.generate([prompts[0]], sampling_params=sp)
    assert len(fused) == n and out[0] == on[0][:4]  # logprobs: the sampler's path
