"""The one home for private torch APIs (``torch._*``, private attributes of torch objects).

Nothing else in ``framework``, ``backends``, ``passes``, ``models`` or ``experiments`` may
reach into torch's private namespaces; it calls a named function here instead.  Each one
says what it wraps and the torch versions it was checked on (:data:`CHECKED_ON`), and fails
closed where a public path exists:

* a required private API that is gone raises :class:`Unavailable` naming the API and the
  torch version (never an ``AttributeError`` deep inside a compile);
* an optional path (the lean warm start, the CUDA-graph emulation hooks, weak output
  references) is disabled with ONE warning per process (:func:`warn_once`) and the public
  path runs instead.

This is the lowest layer: it imports only torch, and never imports Dynamo or Inductor at
import time (a warm start must not pay for them; each function imports what it needs).
``tests/framework/compat`` exercises every function on the installed torch; CI runs it on
torch 2.13 (the main venv) and 2.11 (the GPU image's stack).

Modules: :mod:`~framework.compat.ops` (op objects, FX, fake tensors, dispatch modes, pytree,
private ops), :mod:`~framework.compat.dynamo`, :mod:`~framework.compat.inductor`
(Inductor and AOTAutograd, the lean warm start's hooks), :mod:`~framework.compat.tensors`
(storage internals).
"""

from __future__ import annotations

from framework.compat.versions import (
    CHECKED_ON,
    Unavailable,
    torch_version,
    warn_once,
)

__all__ = ["CHECKED_ON", "Unavailable", "torch_version", "warn_once"]
