"""Run by ``torchrun`` in tests/framework/engine/test_parallel_tp.py: every rank builds the
TP=2 LLM (ranks > 0 serve rank 0 inside ``LLM(...)`` and exit when it closes); rank 0
generates and prints the tokens as one ``RESULT <json>`` line.

    python -m torch.distributed.run --standalone --nproc_per_node 2 torchrun_generate.py \\
        <checkpoint> '<prompts json>' <max_new_tokens>
"""

from __future__ import annotations

import json
import os
import sys

import torch

from framework.engine.llm import LLM


def main() -> None:
    torch.set_num_threads(1)
    path, prompts, max_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(path, tensor_parallel_size=2, max_model_len=128, optimization_level=0)
    # Only rank 0 gets here: the other rank served its steps and exited inside LLM(...).
    try:
        tokens = llm.generate(prompts, max_new_tokens=max_new)
    finally:
        llm.close()
    print("RESULT " + json.dumps({"rank": int(os.environ["RANK"]), "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
