"""Symbolic sizes made concrete: the token-count symbol of a piece's example inputs set to one
size. The backend compiles single-size ranges with such inputs; the pass verifier runs pieces
on them. One definition for both."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:  # annotations only: importing sympy costs ~0.3 s of a warm start
    import sympy


def free_symbols(values: list[Any]) -> dict[sympy.Symbol, Optional[int]]:
    """Free shape symbols of ``values`` (fake tensors, SymInts) -> their example hints."""
    out: dict[sympy.Symbol, Optional[int]] = {}
    for val in values:
        sizes = (
            [val]
            if isinstance(val, torch.SymInt)
            else list(val.shape)
            if isinstance(val, torch.Tensor)
            else []
        )
        for s in sizes:
            if isinstance(s, torch.SymInt):
                env = s.node.shape_env
                hint = (
                    getattr(env, "backed_var_to_val", None) or getattr(env, "var_to_val", {})
                    if env is not None
                    else {}
                )
                for sym in s.node.expr.free_symbols:
                    out.setdefault(sym, int(hint[sym]) if sym in hint else None)
    return out


def symbol_bindings(values: list[Any], size: int) -> dict[sympy.Symbol, int]:
    """Concrete values of the shape symbols.  A piece's one symbol is the token count: it gets
    ``size``.  With several symbols, the token symbols are taken to be the leading-dim symbols
    whose example value equals that of the first value with a symbolic leading dim (its
    hidden states or positions); they get ``size`` and every other symbol keeps its example
    value, so shapes stay consistent with each other."""
    symbols = free_symbols(values)
    if len(symbols) == 1:
        return {sym: size for sym in symbols}
    leading = [
        v.shape[0].node.expr
        for v in values
        if isinstance(v, torch.Tensor)
        and v.dim() > 0
        and isinstance(v.shape[0], torch.SymInt)
        and v.shape[0].node.expr in symbols
    ]
    token_hint = symbols[leading[0]] if leading else None
    tokens = {e for e in leading if symbols[e] == token_hint}
    return {sym: size if (sym in tokens or hint is None) else hint for sym, hint in symbols.items()}


def concrete_int(value: Any, bindings: dict[sympy.Symbol, int]) -> int:
    """``value`` (an int or a SymInt) with its symbols replaced by ``bindings``."""
    if isinstance(value, torch.SymInt):
        return int(value.node.expr.xreplace(bindings))
    return int(value)


def concretize_inputs(example_inputs: list, size: int) -> list:
    """Real tensors/ints with the token symbol set to ``size`` (:func:`symbol_bindings`): shape,
    stride and storage offset are concretized together since all three can hold the symbol.
    Tensor values are uninitialised: only shapes matter (compiling for one size)."""
    bindings = symbol_bindings(list(example_inputs), size)
    out = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            shape = [concrete_int(s, bindings) for s in x.shape]
            stride = [concrete_int(s, bindings) for s in x.stride()]
            offset = concrete_int(x.storage_offset(), bindings)
            extent = offset + sum((n - 1) * st for n, st in zip(shape, stride) if n > 0) + 1
            base = torch.empty(extent, dtype=x.dtype, device=x.device)
            out.append(base.as_strided(shape, stride, offset))
        elif isinstance(x, torch.SymInt):
            out.append(concrete_int(x, bindings))
        else:
            out.append(x)
    return out
