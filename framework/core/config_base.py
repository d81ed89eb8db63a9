"""Strict dataclass configs: unknown fields rejected, one clear error per bad field, a stable
hash that ignores paths and logging.

A config class is a ``@dataclass`` subclass of :class:`StrictConfig`.  Mark a field that must
not enter the cache key with ``field(..., metadata=NO_HASH)`` (paths, logging, progress bars).
Fields whose value is ``None`` mean "not set by the user": optimization levels fill them.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import typing
from typing import Any, ClassVar, Mapping

NO_HASH = {"hash": False}
"""Field metadata: leave this field out of :meth:`StrictConfig.compute_hash`."""


def _unwrap_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return non_none[0]
    return tp


def _coerce(owner: str, name: str, tp: Any, value: Any) -> Any:
    """Convert plain data (from YAML / kwargs) into the declared field type."""
    if value is None:
        return None
    tp = _unwrap_optional(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        parse = getattr(tp, "parse", None)
        if parse is not None:
            try:
                return parse(value)
            except ValueError as e:
                raise ValueError(f"{owner}.{name}: {e}") from None
        try:
            return tp[str(value).upper()]
        except KeyError:
            raise ValueError(
                f"{owner}.{name}: unknown value {value!r}; expected one of {[m.name for m in tp]}"
            ) from None
    if isinstance(tp, type) and issubclass(tp, StrictConfig):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return tp.from_dict(value, _prefix=f"{owner}.{name}")
        raise ValueError(f"{owner}.{name}: expected a mapping for {tp.__name__}, got {value!r}")
    origin = typing.get_origin(tp)
    if origin in (list, tuple) and not isinstance(value, (str, bytes)):
        try:
            return list(value)
        except TypeError:
            raise ValueError(f"{owner}.{name}: expected a list, got {value!r}") from None
    if origin is dict and isinstance(value, Mapping):
        return dict(value)
    return value


class StrictConfig:
    """Mixin for config dataclasses.  Subclasses implement :meth:`validate`."""

    renamed_fields: ClassVar[dict[str, str]] = {}
    """Old field name -> new one: passing an old name is an error that names its new one."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any] | None = None, _prefix: str | None = None, **kwargs: Any
    ):
        """Build from plain data; unknown keys are a ``ValueError`` naming them."""
        owner = _prefix or cls.__name__
        data = dict(data or {}, **kwargs)
        names = cls.field_names()
        old = sorted(k for k in data if k in cls.renamed_fields)
        if old:
            moved = [f"{owner}.{k} was renamed to {owner}.{cls.renamed_fields[k]}" for k in old]
            raise ValueError("; ".join(moved))
        unknown = sorted(k for k in data if k not in names)
        if unknown:
            raise ValueError(
                f"{owner}: unknown field(s) {unknown}; valid fields are {sorted(names)}"
            )
        hints = typing.get_type_hints(cls)
        values = {k: _coerce(owner, k, hints[k], v) for k, v in data.items()}
        return cls(**values)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            coerced = _coerce(type(self).__name__, f.name, hints[f.name], value)
            if coerced is not value:
                object.__setattr__(self, f.name, coerced)
        self.validate()

    def validate(self) -> None:  # pragma: no cover - overridden
        """Raise ``ValueError`` naming the field for any bad value."""

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (enums by name), suitable for JSON and YAML."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def hash_factors(self) -> dict[str, Any]:
        """The fields that enter the hash: every field except those marked ``NO_HASH``."""
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.metadata.get("hash", True) is False:
                continue
            value = getattr(self, f.name)
            out[f.name] = value.hash_factors() if isinstance(value, StrictConfig) else _plain(value)
        return out

    def compute_hash(self) -> str:
        payload = json.dumps(self.hash_factors(), sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _plain(value: Any) -> Any:
    if isinstance(value, StrictConfig):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def check_sizes(
    owner: str,
    name: str,
    sizes: list[int] | None,
    *,
    upper: int | None = None,
    allow_zero: bool = False,
) -> None:
    """Sizes must be positive ints without duplicates and at most ``upper``."""
    if sizes is None:
        return
    seen = set()
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"{owner}.{name}: sizes must be integers, got {s!r}")
        if s < 0 or (s == 0 and not allow_zero):
            raise ValueError(f"{owner}.{name}: sizes must be positive, got {s}")
        if s in seen:
            raise ValueError(f"{owner}.{name}: duplicate size {s}")
        if upper is not None and s > upper:
            raise ValueError(
                f"{owner}.{name}: size {s} is above max_num_tokens={upper}; "
                f"lower it or raise max_num_tokens"
            )
        seen.add(s)
