"""The tokenizer of the synthetic-task checkpoints: one token per character of
``experiments.synthetic.task.SYMBOLS`` (digits, ``+``, ``=``), ``</s>`` for EOS (id 12) and
three unused ids (13-15), written with the ``tokenizers`` library as a Hugging Face
tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) that ``AutoTokenizer`` loads.

    python -m experiments.synthetic.tokenizer models/synthetic/addition          # write
    python -m experiments.synthetic.tokenizer models/synthetic/addition --check  # verify

The tokenizer speaks the model's own notation, where every number is written least
significant digit first (``"321+654="`` -> ``"9750"`` is 123 + 456 = 0579).
:func:`to_model_notation` / :func:`from_model_notation` convert from / to the usual one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from experiments.synthetic.task import EOS_ID, SYMBOLS, VOCAB_SIZE

EOS_TOKEN = "</s>"
FILES = ("tokenizer.json", "tokenizer_config.json")


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {c: i for i, c in enumerate(SYMBOLS)}
    vocab[EOS_TOKEN] = EOS_ID
    for i in range(EOS_ID + 1, VOCAB_SIZE):
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)


def write(model_dir: str | Path) -> list[Path]:
    build_tokenizer().save_pretrained(str(model_dir))
    return [Path(model_dir) / f for f in FILES]


def check(model_dir: str | Path) -> list[str]:
    """Differences between the folder's tokenizer files and a fresh build (empty: same)."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        write(tmp)
        for f in FILES:
            have, want = Path(model_dir) / f, Path(tmp) / f
            if not have.is_file():
                problems.append(f"{have}: missing")
            elif json.loads(have.read_text()) != json.loads(want.read_text()):
                problems.append(f"{have}: differs from a fresh build; regenerate it")
    return problems


def to_model_notation(prompt: str, width: int = 3) -> str:
    """``"123+456="`` -> ``"321+654="``: each number zero-padded to ``width`` digits (the
    task's operand size) and written least significant digit first."""
    return re.sub(r"\d+", lambda m: m.group(0).zfill(width)[::-1], prompt)


def from_model_notation(answer: str) -> str:
    """``"9750"`` -> ``"579"`` (back to most significant digit first, no leading zeros)."""
    digits = answer[::-1].lstrip("0")
    return digits or ("0" if answer else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--check", action="store_true", help="verify instead of writing")
    args = ap.parse_args(argv)
    if args.check:
        problems = check(args.model_dir)
        print("\n".join(problems) or "tokenizer files up to date")
        return 1 if problems else 0
    for p in write(args.model_dir):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
