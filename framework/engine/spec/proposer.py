"""The proposer contract: what the engine asks of a drafter, and the registry of drafters.

Every step the engine calls ``proposer.propose(reqs)`` with its running requests that are
decoding (their prompt is computed; only the last token is new), schedules each request's
drafts as one chunk of ``1 + len(drafts)`` query tokens, verifies them in the target's forward
and keeps the accepted prefix plus one token of the target's (rejection sampling,
``framework.engine.spec.rejection``).  When a request finishes, is aborted or preempted the
engine calls ``release(req_id)``.

Rollback contract: a proposer never learns which drafts were accepted by a callback; on every
``propose`` it compares its own state with ``req.all_tokens()`` (the accepted tokens) and keeps
only the common prefix (a draft model keeps, per request, the token ids it has KV for and
recomputes from the first position where they differ).  Rejected drafts need no hook.

Proposers register by name (``SpeculativeConfig.method``)::

    @register_proposer("ngram")
    class NgramProposer:
        def __init__(self, config: SpeculativeConfig, context: ProposerContext): ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from framework.core.config import CompilationConfig
from framework.core.registry import Registry
from framework.engine.request import Request
from framework.engine.spec.config import SpeculativeConfig
from models.config import ModelConfig


class Proposer(Protocol):
    num_speculative_tokens: int
    """k: the most drafts :meth:`propose` returns per request."""

    def propose(self, reqs: Sequence[Request]) -> list[list[int]]:
        """Up to k draft tokens per request (fewer or none allowed), for the tokens that
        follow ``req.all_tokens()``.  Called once per verify step with the decode requests."""
        ...

    def draft_probs(self) -> Optional[list[Optional[torch.Tensor]]]:
        """Per request of the last :meth:`propose` call: the ``[len(drafts), vocab]`` float
        probabilities its drafts were *sampled* from (verification then accepts with
        ``min(1, p/q)``), or None for drafts chosen deterministically (n-gram lookup, a
        greedy draft model: q is one-hot).  None for the whole batch: all deterministic."""
        ...

    def release(self, req_id: int) -> None:
        """The request finished, was aborted or preempted: drop its state (draft KV)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Proposer-specific numbers, merged into ``LLM.stats`` (prefixed ``spec_``)."""
        ...


@dataclass
class ProposerContext:
    """What the engine tells a proposer about the target it drafts for."""

    model_config: ModelConfig
    """The target's model config (vocabulary, EOS ids, max positions)."""
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    compilation_config: CompilationConfig
    """The target's resolved config (a draft compiles with its own copy of it, in its own
    cache namespace)."""
    cache_dir: Optional[str] = None
    """The compile cache root the target uses (None: the default root)."""
    block_size: int = 16
    seed: int = 0


ProposerFactory = Callable[[SpeculativeConfig, ProposerContext], Proposer]

PROPOSERS: Registry[ProposerFactory] = Registry(
    "speculative proposer",
    builtin_modules=("framework.engine.spec.ngram", "framework.engine.spec.draft"),
    entry_point_group="piecewise.proposers",
)
"""``SpeculativeConfig.method`` -> a factory ``(config, context) -> Proposer``."""


def register_proposer(name: str, **meta: Any) -> Callable[[Any], Any]:
    """Class (or factory) decorator: ``@register_proposer("ngram")``."""
    return PROPOSERS.register(name, **meta)


def build_proposer(config: SpeculativeConfig, context: ProposerContext) -> Proposer:
    """The registered proposer of ``config.method`` (an unknown method is a ``ValueError``
    naming the field and the registered methods)."""
    if config.method not in PROPOSERS:
        raise ValueError(
            f"SpeculativeConfig.method: no proposer {config.method!r} is registered; "
            f"registered: {PROPOSERS.names()}"
        )
    proposer = PROPOSERS.get(config.method)(config, context)
    k = proposer.num_speculative_tokens
    if k != config.num_speculative_tokens:
        raise ValueError(
            f"SpeculativeConfig.method: proposer {config.method!r} reports "
            f"num_speculative_tokens={k!r}, the config asks for {config.num_speculative_tokens}"
        )
    return proposer
