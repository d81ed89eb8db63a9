"""How often a draft model's tokens would be accepted by its target under greedy speculative
decoding, measured with the draft proposer alone (no verify step needed).

Greedy verification accepts a draft token exactly when it equals the target's greedy token
there, and the output is the target's greedy output.  So the target's continuations are
generated once, and the speculative loop is replayed against them: per request, the draft
proposes up to k tokens after the tokens accepted so far (``DraftModelProposer.propose``, batched
over the requests, with its KV rollback), the accepted prefix plus the target's next token are
appended, and so on until the request's output is complete.

    python -m experiments.synthetic.draft_acceptance models/synthetic/addition \\
        models/synthetic/addition-draft -k 4 -n 200

Reports: drafted and accepted tokens, the acceptance rate, the per-position acceptance (of the
verify steps that proposed a j-th draft, the fraction whose first j drafts were all accepted)
and the mean tokens per verify step (accepted drafts + the target's own token); a step without
drafts (one token left to generate) is a plain decode step and not counted, as in the
engine's ``spec_*`` statistics.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from framework import LLM
from framework.engine.request import Request
from framework.engine.spec.config import SpeculativeConfig
from framework.engine.spec.proposer import ProposerContext, build_proposer


@dataclass
class Acceptance:
    """Counts of a replayed greedy speculative decoding (see the module docstring)."""

    k: int
    requests: int = 0
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    proposed_at: list[int] = field(default_factory=list)
    """Per draft position j: verify steps that proposed a j-th draft."""
    accepted_at: list[int] = field(default_factory=list)
    """Per draft position j: verify steps whose first j drafts were all accepted."""

    def __post_init__(self) -> None:
        self.proposed_at = self.proposed_at or [0] * self.k
        self.accepted_at = self.accepted_at or [0] * self.k

    def add_step(self, num_drafts: int, num_accepted: int) -> None:
        self.verify_steps += 1
        self.drafted_tokens += num_drafts
        self.accepted_tokens += num_accepted
        for j in range(num_drafts):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < num_accepted

    def as_dict(self) -> dict[str, Any]:
        d, a, s = self.drafted_tokens, self.accepted_tokens, self.verify_steps
        return {
            "k": self.k,
            "requests": self.requests,
            "verify_steps": s,
            "drafted_tokens": d,
            "accepted_tokens": a,
            "acceptance_rate": a / d if d else None,
            "per_position_acceptance": [
                acc / n if n else None for acc, n in zip(self.accepted_at, self.proposed_at)
            ],
            "mean_accepted_length": (a + s) / s if s else None,
        }


def replay_acceptance(
    proposer: Any,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    counts: Optional[Acceptance] = None,
) -> Acceptance:
    """Replay greedy speculative decoding of ``prompts`` (at most the proposer's
    ``max_num_seqs`` at once) whose target outputs are ``continuations``; the first new token
    comes from the prefill, as in the engine.  Adds to ``counts`` when given."""
    counts = counts or Acceptance(proposer.num_speculative_tokens)
    reqs = [
        Request(i, list(p), max_new_tokens=max(1, len(c)))
        for i, (p, c) in enumerate(zip(prompts, continuations))
    ]
    counts.requests += len(reqs)
    for r, c in zip(reqs, continuations):
        r.output = list(c[:1])
    active = [r for r, c in zip(reqs, continuations) if len(r.output) < len(c)]
    while active:
        drafts = proposer.propose(active)
        for r, d in zip(active, drafts):
            truth = list(continuations[r.req_id][len(r.output) :])
            a = 0
            while a < len(d) and a < len(truth) and d[a] == truth[a]:
                a += 1
            if d:  # no drafts (one token left): a plain decode step, as in the engine
                counts.add_step(len(d), a)
            r.output += truth[: a + 1]
        active = [r for r in active if len(r.output) < len(continuations[r.req_id])]
    for r in reqs:
        proposer.release(r.req_id)
    return counts


def draft_acceptance(
    target_dir: str,
    draft_dir: str,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    k: int = 4,
    *,
    dtype: str = "float32",
    optimization_level: int = 0,
    cache_dir: Optional[str] = None,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """Acceptance of ``draft_dir``'s drafts against ``target_dir``'s greedy outputs."""
    target = LLM(
        target_dir,
        dtype=dtype,
        optimization_level=optimization_level,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        cache_dir=cache_dir,
    )
    continuations = target.generate(
        [list(p) for p in prompts], max_new_tokens, ignore_eos=ignore_eos
    )
    context = ProposerContext(
        model_config=target.model_config,
        dtype=target.dtype,
        device=target.device,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        compilation_config=target.config,
        cache_dir=cache_dir,
    )
    config = SpeculativeConfig(method="draft_model", model=draft_dir, num_speculative_tokens=k)
    proposer = build_proposer(config, context)
    counts = Acceptance(k)
    for start in range(0, len(prompts), max_num_seqs):
        end = start + max_num_seqs
        replay_acceptance(proposer, prompts[start:end], continuations[start:end], counts)
    return {"target": str(target_dir), "draft": str(draft_dir), **counts.as_dict()}


def main(argv: Optional[list[str]] = None) -> int:
    from experiments.synthetic.task import get_task, read_task_name

    p = argparse.ArgumentParser(
        prog="python -m experiments.synthetic.draft_acceptance",
        description="Greedy acceptance of a draft model's tokens by its target",
    )
    p.add_argument("target")
    p.add_argument("draft")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("-n", type=int, default=200, help="held-out prompts of the target's task")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("-O", dest="level", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    task = get_task(read_task_name(args.target))
    prompts, _ = task.split(task.sequences(task.held_out_keys(args.n, args.seed)))
    res = draft_acceptance(
        args.target,
        args.draft,
        prompts,
        task.answer_len + 1,
        args.k,
        dtype=args.dtype,
        optimization_level=args.level,
    )
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
