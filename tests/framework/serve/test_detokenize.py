"""Incremental detokenisation: multi-byte characters split over byte tokens, stop strings
split over chunks, and the streamed text equal to the whole decode."""

import random

import pytest
from checkpoints import write_byte_tokenizer
from transformers import AutoTokenizer

from framework.serve.detokenize import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(chat_model_dir):
    return AutoTokenizer.from_pretrained(str(chat_model_dir))


def stream(tok, ids, stop=(), step=1):
    """Push ``ids`` ``step`` tokens at a time; the deltas, and the detokenizer."""
    d = IncrementalDetokenizer(tok, stop)
    deltas = []
    for n in range(step, len(ids) + step, step):
        n = min(n, len(ids))
        deltas.append(d.push(ids[:n], finished=n == len(ids)))
        if d.stopped:
            break
    return deltas, d


def test_multibyte_characters_appear_whole(tok):
    text = "héllo € 𝄞 wörld"
    ids = list(text.encode())
    assert tok(text)["input_ids"] == ids  # byte tokenizer: id == byte
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # the 4-byte clef arrives with its last byte, not before
    clef = text.index("𝄞")
    assert "𝄞" in deltas[len(text[:clef].encode()) + 3]


@pytest.mark.parametrize("seed", range(5))
def test_streamed_text_equals_the_whole_decode_of_random_bytes(tok, seed):
    g = random.Random(seed)
    ids = [g.randrange(256) for _ in range(200)]
    for step in (1, 3):
        deltas, _ = stream(tok, ids, step=step)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def test_output_ending_inside_a_character_is_flushed(tok):
    ids = list("ab€".encode())[:-1]  # the euro sign cut after 2 of its 3 bytes
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == "ab\ufffd"


def test_stop_string_split_over_chunks_is_cut_and_never_sent(tok):
    text = "one two STOP three"
    ids = list(text.encode())
    deltas, d = stream(tok, ids, stop=["STOP"])
    assert "".join(deltas) == "one two "
    assert d.stopped == "STOP" and d.num_tokens == len("one two STOP")
    # "ST" is held back until "STOP" is complete: no delta ever holds part of it
    assert not any("S" in x for x in deltas)


def test_a_held_back_prefix_that_is_not_a_stop_is_released(tok):
    ids = list("a STx b".encode())
    deltas, d = stream(tok, ids, stop=["STOP"])
    assert "".join(deltas) == "a STx b" and d.stopped is None
    assert deltas[3] == "" and deltas[4] == "STx"  # held at "ST", released at "STx"


def test_the_earliest_of_several_stops_wins(tok):
    ids = list("xx abc yy".encode())
    deltas, d = stream(tok, ids, stop=["c yy", "ab"], step=9)
    assert "".join(deltas) == "xx " and d.stopped == "ab"


def test_multibyte_stop_string(tok):
    ids = list("price 10€ only".encode())
    deltas, d = stream(tok, ids, stop=["€"])
    assert "".join(deltas) == "price 10" and d.num_tokens == len("price 10€".encode())


def test_without_a_tokenizer_there_is_no_text():
    d = IncrementalDetokenizer(None)
    assert d.push([1, 2, 3], finished=False) == "" and d.num_tokens == 3


def test_byte_tokenizer_helper(tmp_path, llama_checkpoint):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(llama_checkpoint, d)
    write_byte_tokenizer(d, chat_template=None)
    t = AutoTokenizer.from_pretrained(str(d))
    assert len(t) == 256 and not t.chat_template and t.eos_token_id == 2
