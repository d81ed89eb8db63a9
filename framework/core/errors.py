"""Errors whose message is the whole story.

A :class:`CompileStepError` is raised inside a compile (by a pass, or by the pass verifier)
with a message that names what failed and where (piece, compile range, pass).  Dynamo and
Inductor wrap whatever a backend raises in their own exceptions, tens of frames deep; the
compile spine (``framework.compile.trace_once``) finds this error in that chain, logs the
wrapped traceback at DEBUG, and raises it unwrapped, so the user's last line is the message.
"""

from __future__ import annotations


class CompileStepError(AssertionError):
    """A compile step failed with a complete, user-facing message."""


def find_compile_step_error(exc: BaseException) -> CompileStepError | None:
    """The first :class:`CompileStepError` in ``exc``'s cause/context chain (Dynamo's
    ``BackendCompilerFailed`` keeps it as ``inner_exception`` too), or None."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CompileStepError):
            return e
        todo += [getattr(e, "inner_exception", None), e.__cause__, e.__context__]
    return None
