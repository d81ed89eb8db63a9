"""The speculative-decoding configuration: which proposer, how many draft tokens.

    LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    python -m experiments.run speculative=ngram speculative.num_speculative_tokens=4

A strict dataclass (``framework.core.config_base``): unknown fields and bad values are one
``ValueError`` naming the field.  :meth:`SpeculativeConfig.compute_hash` is part of the
compile-cache key of the target (it changes the compiled sizes: verify steps run ``1 + k``
query tokens per request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from framework.core.config_base import StrictConfig

METHODS = ("ngram", "draft_model")
"""The built-in proposers (plugins registered in ``PROPOSERS`` are accepted too)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SpeculativeConfig(StrictConfig):
    """How draft tokens are proposed and verified."""

    method: str = "ngram"
    """``ngram`` (prompt lookup over the request's own tokens) or ``draft_model`` (a second,
    smaller model with the same vocabulary: :attr:`model`)."""
    num_speculative_tokens: int = 4
    """k: draft tokens proposed per request and step; the target verifies ``1 + k``."""
    prompt_lookup_min: int = 1
    """ngram: the shortest suffix n-gram looked up in the request's earlier tokens."""
    prompt_lookup_max: int = 3
    """ngram: the longest suffix n-gram tried first."""
    prompt_lookup_periodic: bool = True
    """ngram: when the tokens after the match run out before k (the match is the last
    repetition of a loop of period p < k), continue the drafts periodically (draft t is draft
    t - p) instead of proposing only p.  False: propose what follows the match, no more."""
    model: Optional[str] = None
    """draft_model: the draft's Hugging Face folder (config.json + safetensors)."""
    draft_hash: Optional[str] = None
    """draft_model: identity of the draft (its model-config hash and weights), filled by the
    draft proposer when it loads; part of :meth:`compute_hash`."""
    draft_compile: Optional[dict[str, Any]] = None
    """draft_model: CompilationConfig fields for the draft (default: the target's)."""
    draft_dtype: Optional[str] = None
    """draft_model: the draft's dtype (default: the target's)."""

    def validate(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(
                f"SpeculativeConfig.method: expected one of {list(METHODS)}, got {self.method!r}"
            )
        if self.method not in METHODS:
            from framework.engine.spec.proposer import PROPOSERS

            if self.method not in PROPOSERS:
                raise ValueError(
                    f"SpeculativeConfig.method: unknown method {self.method!r}; "
                    f"expected one of {sorted(set(METHODS) | set(PROPOSERS.names()))}"
                )
        k = self.num_speculative_tokens
        if not _is_int(k) or k < 1:
            raise ValueError(
                f"SpeculativeConfig.num_speculative_tokens: must be an int >= 1, got {k!r} "
                f"(no speculative_config at all turns speculation off)"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not _is_int(lo) or lo < 1:
            raise ValueError(
                f"SpeculativeConfig.prompt_lookup_min: must be an int >= 1, got {lo!r}"
            )
        if not _is_int(hi) or hi < lo:
            raise ValueError(
                f"SpeculativeConfig.prompt_lookup_max: must be an int >= prompt_lookup_min "
                f"({lo}), got {hi!r}"
            )
        if not isinstance(self.prompt_lookup_periodic, bool):
            raise ValueError(
                f"SpeculativeConfig.prompt_lookup_periodic: must be true or false, got "
                f"{self.prompt_lookup_periodic!r}"
            )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "SpeculativeConfig.model: method 'draft_model' needs the draft's Hugging "
                    "Face folder"
                )
        elif self.method == "ngram" and self.model is not None:
            raise ValueError(
                f"SpeculativeConfig.model: method 'ngram' takes no draft model, got "
                f"{self.model!r} (use method='draft_model')"
            )

    @property
    def query_len(self) -> int:
        """Query tokens per request in a verify step: the last token plus k drafts."""
        return 1 + self.num_speculative_tokens

    def validate_for(
        self,
        target_model_config: Any,
        max_model_len: int,
        draft_model_config: Any = None,
    ) -> None:
        """The checks against the target (and the draft, once loaded): one ``ValueError``
        naming the field.  ``*_model_config``: ``models.config.ModelConfig``."""
        if self.query_len > max_model_len:
            raise ValueError(
                f"SpeculativeConfig.num_speculative_tokens: {self.num_speculative_tokens} "
                f"draft tokens + 1 exceed max_model_len={max_model_len}"
            )
        if draft_model_config is None:
            return
        tv, dv = target_model_config.vocab_size, draft_model_config.vocab_size
        if tv != dv:
            raise ValueError(
                f"SpeculativeConfig.model: the draft's vocabulary ({dv} tokens, "
                f"{self.model}) differs from the target's ({tv} tokens); a draft must share "
                f"the target's tokenizer"
            )
        draft_len = draft_model_config.max_position_embeddings
        if draft_len < max_model_len:
            raise ValueError(
                f"SpeculativeConfig.model: the draft ({self.model}) holds at most "
                f"{draft_len} positions, fewer than the target's max_model_len="
                f"{max_model_len}; lower max_model_len or use a longer draft"
            )

    def hash_factors(self) -> dict[str, Any]:
        """What changes the target's compiled code or sizes: the method, k and the draft's
        identity (the lookup lengths change no compiled code)."""
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "draft": self.draft_hash if self.draft_hash is not None else self.model,
        }


def speculative_config_of(value: Any) -> Optional[SpeculativeConfig]:
    """``LLM(speculative_config=...)``: None, a :class:`SpeculativeConfig` or a mapping (a
    mapping without a method, or with ``method: null``, is "off": the Hydra ``none``
    option)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, dict) or hasattr(value, "keys"):
        data = dict(value)
        if data.get("method") is None:
            rest = {k: v for k, v in data.items() if k != "method" and v is not None}
            if rest:
                raise ValueError(
                    f"SpeculativeConfig.method: not set, but {sorted(rest)} given; name a "
                    f"method ({list(METHODS)}) or drop the other fields"
                )
            return None
        return SpeculativeConfig.from_dict(data)
    raise ValueError(
        f"LLM.speculative_config: expected a SpeculativeConfig, a dict or None, got "
        f"{type(value).__name__}"
    )


__all__ = ["METHODS", "SpeculativeConfig", "speculative_config_of"]
