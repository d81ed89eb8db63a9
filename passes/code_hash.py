"""Hash of the code that will run: the live code objects of a module, not its file on disk.

A pass's ``uuid()`` enters the artifact-cache key.  Hashing the pass's *file* is unsound inside
a long-lived process: after an edit on disk without a reload, the key would name the new
source while the old code (already imported) runs, and the artifacts built by the old code
would be stored under the new key, where a fresh process running the new code finds them.

So the hash is taken over what the interpreter executes: for every function and class the
module defines, its code objects (bytecode, constants, names, recursively into nested code),
default arguments and plain class/module constants.  Edited-but-not-reloaded source leaves the
hash unchanged (old code, old key); a fresh process, or a reload, hashes the new code.  Nothing
location- or run-dependent enters (file names, line numbers, ``id()``s, set iteration order),
so two processes with the same code agree.  Comments, docstrings and whitespace do not change
the code, hence not the key: a docstring is the first constant of its function's code object
(CPython 3.11–3.13 always reserve that slot: the docstring or ``None``; 3.14 marks it with
``CO_HAS_DOCSTRING``), and it is left out, as are class docstrings (``__doc__``).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import sys
import types
from typing import Any

_SIMPLE = (str, int, float, bool, bytes, type(None), complex)


_CO_OPTIMIZED = inspect.CO_OPTIMIZED
_CO_HAS_DOCSTRING = getattr(inspect, "CO_HAS_DOCSTRING", 0)  # Python 3.14+


def _docstring_slot(code: types.CodeType) -> bool:
    """Whether ``co_consts[0]`` is the docstring slot: before 3.14 a ``def`` function's (not
    a lambda's, a comprehension's or a class body's) first constant is its docstring or
    ``None``, so adding, editing or removing a docstring leaves the other constants alone."""
    if _CO_HAS_DOCSTRING:
        return bool(code.co_flags & _CO_HAS_DOCSTRING)
    return (
        bool(code.co_flags & _CO_OPTIMIZED)
        and not code.co_name.startswith("<")
        and bool(code.co_consts)
        and (code.co_consts[0] is None or isinstance(code.co_consts[0], str))
    )


def _code_parts(code: types.CodeType, out: list[str]) -> None:
    out.append(
        f"code:{code.co_name}:{code.co_argcount}:{code.co_posonlyargcount}:"
        f"{code.co_kwonlyargcount}:{code.co_flags & ~_CO_HAS_DOCSTRING}"
    )
    out.append(code.co_code.hex())
    out.append(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)))
    consts = code.co_consts[1:] if _docstring_slot(code) else code.co_consts
    for const in consts:
        if isinstance(const, types.CodeType):
            _code_parts(const, out)
        else:
            out.append(_value_repr(const))


def _value_repr(value: Any) -> str:
    """A run-independent text for a constant (sets sorted: their order follows str hashing)."""
    if isinstance(value, _SIMPLE):
        return repr(value)
    if isinstance(value, (frozenset, set)):
        return "{" + ",".join(sorted(_value_repr(v) for v in value)) + "}"
    if isinstance(value, (tuple, list)):
        return type(value).__name__ + "(" + ",".join(_value_repr(v) for v in value) + ")"
    if isinstance(value, dict):
        return (
            "dict("
            + ",".join(sorted(f"{_value_repr(k)}:{_value_repr(v)}" for k, v in value.items()))
            + ")"
        )
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, types.CodeType):
        parts: list[str] = []
        _code_parts(value, parts)
        return "\n".join(parts)
    # Ops (torch.ops.aten.add.Tensor), dtypes and other named objects: their name.
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if isinstance(name, str):
        return f"{type(value).__name__}:{getattr(value, '__module__', '')}.{name}"
    text = str(value)
    return f"{type(value).__name__}:{text}" if " at 0x" not in text else type(value).__name__


def _function_parts(fn: Any, out: list[str]) -> None:
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        out.append(_value_repr(fn))
        return
    _code_parts(code, out)
    out.append(_value_repr(fn.__defaults__))
    out.append(_value_repr(fn.__kwdefaults__))


def _class_parts(cls: type, module: str, out: list[str], seen: set[int]) -> None:
    if id(cls) in seen:
        return
    seen.add(id(cls))
    out.append(
        f"class:{cls.__qualname__}:"
        + ",".join(f"{b.__module__}.{b.__qualname__}" for b in cls.__bases__)
    )
    for name, value in sorted(vars(cls).items()):
        if name in ("__dict__", "__weakref__", "__module__", "__doc__"):
            continue
        out.append(f"attr:{name}")
        _member_parts(value, module, out, seen)


def _member_parts(value: Any, module: str, out: list[str], seen: set[int]) -> None:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        for f in (value.fget, value.fset, value.fdel):
            if f is not None:
                _function_parts(f, out)
        return
    if isinstance(value, functools.partial):
        _member_parts(value.func, module, out, seen)
        out.append(_value_repr(value.args) + _value_repr(value.keywords))
        return
    if isinstance(value, type) and value.__module__ == module:
        _class_parts(value, module, out, seen)
    elif isinstance(value, (types.FunctionType, types.MethodType)) or hasattr(value, "__wrapped__"):
        _function_parts(value, out)
    else:
        out.append(_value_repr(value))


def module_code_hash(module_name: str) -> str:
    """sha256 over the live code of everything module ``module_name`` defines (functions,
    classes, constants); objects it merely imports enter by name only."""
    module = sys.modules[module_name]
    out: list[str] = [f"module:{module_name}"]
    seen: set[int] = set()
    for name, value in sorted(vars(module).items()):
        if name.startswith("__") or isinstance(value, types.ModuleType):
            continue
        defined_here = (
            getattr(inspect.unwrap(value) if callable(value) else value, "__module__", None)
            == module_name
        )
        out.append(f"global:{name}")
        if defined_here or isinstance(value, (_SIMPLE, tuple, list, dict, frozenset, set)):
            _member_parts(value, module_name, out, seen)
        elif callable(value):  # imported function/class/op: by name (its module hashes itself)
            out.append(
                f"{getattr(value, '__module__', '')}."
                f"{getattr(value, '__qualname__', None) or getattr(value, '__name__', name)}"
            )
        else:  # imported or constructed objects (loggers, libraries): by type only
            out.append(f"{type(value).__module__}.{type(value).__qualname__}")
    return hashlib.sha256("\n".join(out).encode()).hexdigest()
