"""The one place that reaches into private torch APIs (checked against torch 2.13).

``forget_dynamo_cache``: Dynamo keeps a cache entry per ``torch.compile`` wrapper on the
traced code object, and every LLM traces the same ``forward`` code object.  TraceOnce calls
the compiled program directly after its single trace, so the entry is dead weight; left in
place, entries pile up across LLMs in one process (holding their graphs) until Dynamo's
recompile limit (8) turns the next trace into a hard error.  There is no public API to drop
one code object's entries; ``torch._dynamo.reset()`` would drop every compiled function of
the process.
"""

from __future__ import annotations

import types

import torch


def forget_dynamo_cache(code: types.CodeType) -> None:
    reset_code = getattr(torch._dynamo, "reset_code", None)
    if reset_code is not None:
        reset_code(code)
