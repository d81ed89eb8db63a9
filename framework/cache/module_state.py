"""A processed model as tensors plus plain data, and back: what the processed-weights cache
(:mod:`framework.cache.weights`) stores.

:func:`snapshot` compares the processed model with a *fresh* one (the same class built on the
meta device, nothing loaded) and records, per module, what processing made of it:

* its parameters and buffers exactly (names, order, persistence, ``requires_grad``, shared
  tensors once: a tied embedding stays one Parameter), whatever layouts and dtypes they now
  have -- packed panels, int8 weights and scales, descriptors, a layout added later;
* every plain attribute that differs from the fresh module (``linear_method`` objects, a
  scheme's spec, counters), encoded as plain data: numbers, strings, lists, dicts, dtypes,
  enums, references to other modules of the model, functions and classes by name, and objects
  of the project's own classes by class name and attribute values.

:func:`restore` applies that to another fresh model, with tensors mapped from the file.  There
is no pickle: only classes under :data:`ROOTS` (and torch functions) are ever named, and an
object is rebuilt without calling its ``__init__``.  Something processing produced that this
cannot describe (a foreign object, a new submodule, an opaque tensor) raises
:class:`NotCacheable` naming it; the caller then simply does not cache.
"""

from __future__ import annotations

import enum
import importlib
import inspect
from typing import Any, Optional

import torch
import torch.nn as nn

from framework.cache.weights import CODES

ROOTS = ("framework", "backends", "passes", "models")
"""Top-level packages whose classes a snapshot may name."""
_TORCH_REFS = ("torch",)
_INTERNAL = frozenset(nn.Module().__dict__)  # training, _parameters, hooks, ...
_MAX_DEPTH = 16


class NotCacheable(ValueError):
    """Processing produced state this module cannot describe; the message names it."""


# ----------------------------------------------------------------------------- encoding
class _Encoder:
    def __init__(self, module_paths: dict[int, str], tensors: Optional[dict]) -> None:
        self.module_paths = module_paths
        self.tensors = tensors  # None: probe mode (tensors are not collected)
        self.ids: dict[int, str] = {}
        self.first_kind: dict[str, str] = {}
        self.saw_tensor = False

    def tensor_key(self, t: torch.Tensor, name: str, where: str) -> str:
        key = self.ids.get(id(t))
        if key is not None:
            return key
        if t.layout != torch.strided or t.is_quantized or t.device.type != "cpu":
            raise NotCacheable(f"{where}: a {t.layout} {t.device} tensor is not a dense CPU one")
        if type(t) not in (torch.Tensor, nn.Parameter):
            raise NotCacheable(f"{where}: tensor subclass {type(t).__name__}")
        if t.dtype not in CODES:
            raise NotCacheable(f"{where}: dtype {t.dtype} has no safetensors code")
        key = name
        while key in self.first_kind:
            key += "_"
        self.ids[id(t)] = key
        self.first_kind[key] = "param" if isinstance(t, nn.Parameter) else "tensor"
        if self.tensors is not None:
            self.tensors[key] = t.detach()
        return key

    def encode(self, v: Any, where: str, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise NotCacheable(f"{where}: nested too deeply")
        if isinstance(v, enum.Enum):  # before int/str: an IntEnum is an int
            return {"enum": _name_of(type(v), where), "value": self.encode(v.value, where, depth)}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, torch.Tensor):
            self.saw_tensor = True
            if self.tensors is None:
                return {"tensor": [list(v.shape), str(v.dtype)]}
            return {"tensor": self.tensor_key(v, where, where)}
        if isinstance(v, nn.Module):
            path = self.module_paths.get(id(v))
            if path is None:
                raise NotCacheable(f"{where}: refers to a module outside the model")
            return {"module": path}
        if isinstance(v, torch.dtype):
            return {"dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"device": str(v)}
        if isinstance(v, torch.Size):
            return {"size": list(v)}
        if isinstance(v, (list, tuple)):
            items = [self.encode(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
            return {"tuple" if isinstance(v, tuple) else "list": items}
        if isinstance(v, (set, frozenset)):
            items = sorted((self.encode(x, where, depth + 1) for x in v), key=repr)
            return {"frozenset" if isinstance(v, frozenset) else "set": items}
        if isinstance(v, dict):
            if type(v) is not dict:
                raise NotCacheable(f"{where}: a {type(v).__name__}, not a plain dict")
            return {
                "dict": [
                    [self.encode(k, where, depth + 1), self.encode(x, f"{where}[{k!r}]", depth + 1)]
                    for k, x in v.items()
                ]
            }
        if inspect.isclass(v) or inspect.isfunction(v) or inspect.isbuiltin(v):
            return {"ref": _name_of(v, where, allow_torch=True)}
        cls = type(v)
        if hasattr(v, "__dict__") and not _has_slots(cls):
            return {
                "object": _name_of(cls, where),
                "state": {k: self.encode(x, f"{where}.{k}", depth + 1) for k, x in vars(v).items()},
            }
        raise NotCacheable(f"{where}: {cls.__module__}.{cls.__qualname__} has no plain form")


def _has_slots(cls: type) -> bool:
    return any("__slots__" in vars(k) for k in cls.__mro__ if k is not object)


def _name_of(obj: Any, where: str, allow_torch: bool = False) -> str:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    roots = ROOTS + (_TORCH_REFS if allow_torch else ())
    if not module or not qualname or module.split(".")[0] not in roots or "<" in qualname:
        raise NotCacheable(f"{where}: {obj!r} is not a named object of {roots}")
    name = f"{module}:{qualname}"
    try:
        found = _resolve(name)
    except (ImportError, AttributeError, ValueError):
        found = None
    if found is not obj:
        raise NotCacheable(f"{where}: {name} does not name {obj!r}")
    return name


def _resolve(name: str) -> Any:
    module, _, qualname = name.partition(":")
    if module.split(".")[0] not in ROOTS + _TORCH_REFS:
        raise ValueError(f"{name}: not a module of {ROOTS + _TORCH_REFS}")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _decode(v: Any, tensors: dict[str, Any], model: nn.Module) -> Any:
    if not isinstance(v, dict):
        return v
    (tag, body), *rest = v.items()
    if tag == "tensor":
        return tensors[body]
    if tag == "module":
        return model.get_submodule(body)
    if tag == "dtype":
        dtype = getattr(torch, body)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{body!r} is not a torch dtype")
        return dtype
    if tag == "device":
        return torch.device(body)
    if tag == "size":
        return torch.Size(body)
    if tag in ("list", "tuple", "set", "frozenset"):
        items = [_decode(x, tensors, model) for x in body]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag == "dict":
        return {_decode(k, tensors, model): _decode(x, tensors, model) for k, x in body}
    if tag == "enum":
        return _resolve(body)(_decode(rest[0][1], tensors, model))
    if tag == "ref":
        return _resolve(body)
    if tag == "object":
        cls = _resolve(body)
        if body.partition(":")[0].split(".")[0] not in ROOTS or not inspect.isclass(cls):
            raise ValueError(f"{body}: not a class of {ROOTS}")
        obj = cls.__new__(cls)
        obj.__dict__.update({k: _decode(x, tensors, model) for k, x in rest[0][1].items()})
        return obj
    raise ValueError(f"unknown tag {tag!r}")


# ----------------------------------------------------------------------------- snapshot
def snapshot(model: nn.Module, fresh: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, state)`` of the processed ``model``; ``fresh``: the same class built the
    same way, unprocessed (on the meta device).  ``state`` is plain JSON data; the tensors are
    the model's own (nothing is copied).  Raises :class:`NotCacheable`."""
    modules = dict(model.named_modules())
    fresh_modules = dict(fresh.named_modules())
    if set(modules) != set(fresh_modules):
        extra = sorted(set(modules) ^ set(fresh_modules))
        raise NotCacheable(f"processing changed the module tree ({extra[:5]})")
    paths = {id(m): name for name, m in modules.items()}
    fresh_paths = {id(m): name for name, m in fresh_modules.items()}
    tensors: dict[str, torch.Tensor] = {}
    enc = _Encoder(paths, tensors)
    state: dict[str, Any] = {}
    for name, module in modules.items():
        where = name or "<model>"
        if type(module) is not type(fresh_modules[name]):
            raise NotCacheable(f"{where}: processing replaced the module's class")
        if any(getattr(module, h) for h in ("_forward_hooks", "_forward_pre_hooks")):
            raise NotCacheable(f"{where}: holds forward hooks")
        params = []
        for pname, p in module._parameters.items():
            key = None if p is None else enc.tensor_key(p, _join(name, pname), f"{where}.{pname}")
            extra = enc.encode(vars(p), f"{where}.{pname}.__dict__") if p is not None else {}
            params.append([pname, key, bool(p is not None and p.requires_grad), extra])
        buffers = []
        for bname, b in module._buffers.items():
            key = None if b is None else enc.tensor_key(b, _join(name, bname), f"{where}.{bname}")
            buffers.append([bname, key, bname not in module._non_persistent_buffers_set])
        changed, deleted = {}, []
        fresh_dict = vars(fresh_modules[name])
        for attr, value in vars(module).items():
            if attr in _INTERNAL:
                continue
            if attr in fresh_dict and _same(value, fresh_dict[attr], paths, fresh_paths):
                continue
            changed[attr] = enc.encode(value, f"{where}.{attr}")
        deleted = [a for a in fresh_dict if a not in _INTERNAL and a not in vars(module)]
        state[name] = {"params": params, "buffers": buffers, "set": changed, "del": deleted}
    return tensors, {"modules": state, "kinds": enc.first_kind}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _same(a: Any, b: Any, paths_a: dict[int, str], paths_b: dict[int, str]) -> bool:
    """Whether a processed attribute still equals the fresh model's (so it needs no entry):
    equal plain encodings, no tensor in either (a tensor attribute is always recorded), or
    the very same object (state both models were built with, e.g. the tensor-parallel
    group: the model restored in another process gets its own)."""
    if a is b and not isinstance(a, torch.Tensor):
        return True
    try:
        ea, eb = _Encoder(paths_a, None), _Encoder(paths_b, None)
        same = ea.encode(a, "?") == eb.encode(b, "?")
    except NotCacheable:
        return False
    return same and not ea.saw_tensor and not eb.saw_tensor


# ----------------------------------------------------------------------------- restore
def restore(model: nn.Module, tensors: dict[str, torch.Tensor], state: dict) -> None:
    """Make the fresh ``model`` (meta device) what :func:`snapshot` described, its tensors
    those of ``tensors`` (mapped from the file: not copied).  Raises ``ValueError`` /
    ``KeyError`` on a state that does not fit the model (the caller recomputes)."""
    kinds = state["kinds"]
    objects: dict[str, Any] = {}

    def obj(key: str, requires_grad: bool = False) -> Any:
        if key not in objects:
            t = tensors[key]
            objects[key] = nn.Parameter(t, requires_grad) if kinds[key] == "param" else t
        return objects[key]

    by_key = {k: obj(k) for k in kinds}  # every tensor, in the form it first had
    modules = dict(model.named_modules())
    if set(modules) != set(state["modules"]):
        raise ValueError("the cached state describes another module tree")
    for name, entry in state["modules"].items():
        module = modules[name]
        params = type(module._parameters)()
        for pname, key, requires_grad, extra in entry["params"]:
            p = None if key is None else by_key[key]
            if p is not None:
                p.requires_grad_(requires_grad)
                vars(p).update(_decode(extra, by_key, model))
            params[pname] = p
        buffers = type(module._buffers)()
        non_persistent = set()
        for bname, key, persistent in entry["buffers"]:
            buffers[bname] = None if key is None else by_key[key]
            if not persistent:
                non_persistent.add(bname)
        for attr in entry["del"]:
            module.__dict__.pop(attr, None)
        for attr, value in entry["set"].items():
            module.__dict__[attr] = _decode(value, by_key, model)
        module._parameters, module._buffers = params, buffers
        module._non_persistent_buffers_set = non_persistent
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"the cached state leaves {left[:5]} unloaded")


def describe(model: nn.Module) -> list:
    """(name, kind, shape, dtype) of every tensor and the repr of every module: equal for a
    processed model and its restored copy (a self-check before anything is cached)."""
    out: list = [repr(model)]
    out += [(n, "p", tuple(t.shape), str(t.dtype)) for n, t in model.named_parameters()]
    out += [(n, "b", tuple(t.shape), str(t.dtype)) for n, t in model.named_buffers()]
    return out
