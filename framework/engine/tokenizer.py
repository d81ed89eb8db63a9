"""The model folder's tokenizer (transformers' ``AutoTokenizer``), when it ships one."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(model_dir: str | Path) -> Optional[Any]:
    """The folder's tokenizer, or None when it has neither tokenizer file."""
    d = Path(model_dir)
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        return None
    # Imported here, not at the top: importing transformers costs ~1 s, which a warm start of
    # a model folder without a tokenizer (every test checkpoint) need not pay.
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - any loader failure is reported with the folder
        raise ValueError(
            f"{d}: has tokenizer files but AutoTokenizer could not load them: {e}"
        ) from e


def encode_prompt(tokenizer: Any, text: str, *, chat_template: bool = False) -> list[int]:
    """Token ids of a text prompt; ``chat_template`` wraps it as one user message and adds
    the generation prompt (the tokenizer's own chat template)."""
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat_template=True: the model's tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(text)["input_ids"])


def decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)
