"""``generate``'s sampling parameters per prompt (``params_per_prompt``): the default, one for
every prompt, one each, and the ``max_new_tokens`` / ``ignore_eos`` overrides."""

from __future__ import annotations

import pytest

from framework.engine.sampling_params import SamplingParams, params_per_prompt


def test_default_is_greedy_with_sixteen_tokens_or_the_given_count():
    (p,) = params_per_prompt(None, 1, None, False)
    assert p == SamplingParams(max_tokens=16) and p.greedy and not p.ignore_eos
    got = params_per_prompt(None, 3, 5, True)
    assert got == [SamplingParams(max_tokens=5, ignore_eos=True)] * 3


def test_overrides_replace_the_fields_of_one_or_of_each():
    one = SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=40)
    got = params_per_prompt(one, 2, 8, True)
    assert got == [one.replace(max_tokens=8, ignore_eos=True)] * 2
    assert params_per_prompt(one, 2, None, False) == [one, one]
    each = [one, SamplingParams(max_tokens=3)]
    got = params_per_prompt(each, 2, None, True)
    assert [p.max_tokens for p in got] == [40, 3] and all(p.ignore_eos for p in got)
    assert got[0].temperature == 0.7 and got[1].greedy


@pytest.mark.parametrize("bad", [[SamplingParams()], [SamplingParams(), "greedy"]])
def test_a_list_that_is_not_one_per_prompt_is_refused(bad):
    with pytest.raises(ValueError, match="one SamplingParams or a list of 2"):
        params_per_prompt(bad, 2, None, False)


def test_a_bad_override_names_the_field():
    with pytest.raises(ValueError, match="max_tokens"):
        params_per_prompt(None, 1, 0, False)
