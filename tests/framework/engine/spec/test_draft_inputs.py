"""The draft's input checks on their own (``framework.engine.spec.draft_inputs``); a built
draft model refusing wrong inputs is in ``test_draft.py``."""

import pytest
import torch

from framework.engine.spec.draft_inputs import CheckedForward, DraftInputError, DraftInputSpec

SPEC = DraftInputSpec(torch.int64, torch.int64, max_num_tokens=8, model="tiny-draft")


def ids(n, dtype=torch.int64):
    return torch.arange(n, dtype=dtype)


def test_inputs_it_was_compiled_for_pass():
    SPEC.check(ids(8), ids(8))
    SPEC.check(ids(1), ids(1))


@pytest.mark.parametrize(
    "input_ids,positions,match",
    [
        (ids(4, torch.int32), ids(4), r"tiny-draft: input_ids is torch\.int32 .*compiled for "
         r"torch\.int64"),
        (ids(4), ids(4, torch.int32), r"positions is torch\.int32"),
        (ids(4).view(2, 2), ids(4).view(2, 2), r"input_ids must be 1-d .*\(2, 2\)"),
        (ids(4), ids(3), r"input_ids \(4,\) and positions \(3,\) differ in length"),
        (ids(9), ids(9), r"9 tokens exceed the 8 the draft was compiled for"),
        ([1, 2], ids(2), r"input_ids must be a tensor, got list"),
    ],
)  # fmt: skip
def test_each_mismatch_is_one_error_naming_it(input_ids, positions, match):
    with pytest.raises(DraftInputError, match=match):
        SPEC.check(input_ids, positions)


def test_checked_forward_refuses_before_calling_the_forward():
    calls = []

    def forward(input_ids, positions):
        calls.append(input_ids.dtype)
        return input_ids

    fwd = CheckedForward(forward, SPEC)
    assert torch.equal(fwd(ids(3), ids(3)), ids(3))
    with pytest.raises(DraftInputError):
        fwd(ids(3, torch.int32), ids(3))
    assert calls == [torch.int64]  # the refused call never reached the forward
