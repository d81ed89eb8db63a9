"""Builders of tiny Hugging Face checkpoints for tests (fp32, seeded), and helpers that derive
broken checkpoints from a good one.  The generation recipe itself lives in ``models.tiny`` so
library code (the default model of ``make run``) never imports tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors.torch import load_file, save_file

from models.tiny import write_tiny_checkpoint

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""Dense families."""
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
"""Mixture-of-experts families."""


def build_family_checkpoint(out_dir: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """The ``test-<family>`` preset (2 layers, hidden 64, vocab 256) written to ``out_dir``."""
    return write_tiny_checkpoint(out_dir, f"test-{family}", seed=seed, **overrides)


def build_sharded_checkpoint(out_dir: Path, family: str, max_shard_size: str = "100KB") -> Path:
    """Same weights as :func:`build_family_checkpoint`, saved as several shards + index."""
    from models.tiny import build_hf_model, resolve_preset

    fam, kwargs, dtype = resolve_preset(f"test-{family}")
    build_hf_model(fam, kwargs, 0, dtype).save_pretrained(out_dir, max_shard_size=max_shard_size)
    return Path(out_dir)


def derive_checkpoint(
    src: Path,
    dst: Path,
    edit_tensors: Optional[Callable[[dict[str, torch.Tensor]], None]] = None,
    edit_config: Optional[Callable[[dict], None]] = None,
) -> Path:
    """Copy a single-file checkpoint, editing its tensors dict and/or config dict in place."""
    dst = Path(dst)
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def write_byte_tokenizer(
    model_dir: Path, chat_template: Optional[str] = BYTE_CHAT_TEMPLATE
) -> Path:
    """A byte-level tokenizer for a vocab-256 test checkpoint: token id i is byte i (no merges),
    so any text encodes, multi-byte characters span several tokens, and every id decodes.
    EOS is the model config's ``eos_token_id``; ``chat_template`` None: none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id", 2)
    chars = _bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=chars[eos], clean_up_tokenization_spaces=False
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(model_dir))
    return Path(model_dir)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}
