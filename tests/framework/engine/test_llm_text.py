"""Text in and out: the model folder's tokenizer (AutoTokenizer), string prompts, output
text, the chat template; the synthetic addition checkpoint's own tokenizer."""

import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from experiments.synthetic.task import EOS_ID, SYMBOLS, encode
from experiments.synthetic.tokenizer import (
    build_tokenizer,
    check,
    from_model_notation,
    to_model_notation,
    write,
)
from framework import LLM, SamplingParams

ADDITION = Path(__file__).resolve().parents[3] / "models" / "synthetic" / "addition"


@pytest.fixture(scope="module")
def addition():
    return LLM(str(ADDITION), optimization_level=0, max_model_len=32)


def test_committed_tokenizer_is_the_built_one():
    assert check(ADDITION) == []


def test_check_notices_a_stale_tokenizer(tmp_path):
    write(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "stale"}')
    assert any("differs" in p for p in check(tmp_path))


def test_addition_tokenizer_speaks_the_task_vocabulary():
    tok = AutoTokenizer.from_pretrained(str(ADDITION))
    text = "0123456789+="
    assert tok(text)["input_ids"] == encode(text) == list(range(len(SYMBOLS)))
    assert tok.eos_token_id == EOS_ID
    assert tok.decode(encode("9750") + [EOS_ID], skip_special_tokens=True) == "9750"
    assert len(build_tokenizer()) == 16


def test_notation_helpers():
    assert to_model_notation("123+456=") == "321+654="
    assert to_model_notation("7+45=") == "700+540="
    assert from_model_notation("9750") == "579" and from_model_notation("0000") == "0"


def test_addition_model_answers_text_prompts(addition):
    assert addition.tokenizer is not None
    assert addition.generate(["321+654="]) == ["9750"]  # 123 + 456 = 0579
    answers = addition.generate([to_model_notation(p) for p in ("123+456=", "999+999=")])
    assert [from_model_notation(a) for a in answers] == ["579", "1998"]
    out = addition.generate(["321+654="], return_outputs=True)[0]
    assert out.prompt == "321+654=" and out.prompt_token_ids == encode("321+654=")
    assert out.token_ids == encode("9750") + [EOS_ID] and out.text == "9750"
    assert out.finish_reason == "stop"


def test_text_prompts_through_the_step_api(addition):
    rid = addition.add_request("123+456=", SamplingParams(max_tokens=5))
    outs = []
    while addition.has_unfinished():
        outs += addition.step()
    assert [(o.request_id, o.text) for o in outs] == [(rid, "5790")]  # 321 + 654 = 0975


def test_chat_template_is_applied_when_asked(tmp_path, addition):
    folder = tmp_path / "chat"
    shutil.copytree(ADDITION, folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] | reverse | join('') }}"
        "{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    tok.save_pretrained(str(folder))
    llm = LLM(str(folder), optimization_level=0, max_model_len=32)
    # "456+123" reversed is "321+654", and the generation prompt adds the "=".
    assert llm.generate(["456+123"], chat_template=True) == ["9750"]
    with pytest.raises(ValueError, match="no chat template"):
        addition.generate(["321+654="], chat_template=True)


def test_text_prompt_without_tokenizer_is_an_error(llama_checkpoint):
    llm = LLM(str(llama_checkpoint), optimization_level=0, max_model_len=32)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate(["hello"])
    out = llm.generate([[1, 2, 3]], 2, return_outputs=True)[0]
    assert out.text is None and len(out.token_ids) == 2
