"""One registry helper for every extension point (models, RoPE types, attention backends,
compiler adaptors, passes, kernels, quantization schemes, synthetic tasks).

A :class:`Registry` maps a name to an object plus free-form metadata. Entries come from three
places, in this order the first time the registry is read:

1. decorators in modules that were imported (``@MODELS.register("LlamaForCausalLM", ...)``);
2. the registry's ``builtin_modules``, imported lazily so that importing the registry is cheap;
3. installed packages declaring the registry's entry-point group (``piecewise.passes``, ...):
   each entry point is loaded; a broken plugin is logged by name and skipped, the rest load.

One duplicate policy for all: registering a *different* object under a taken name raises a
``ValueError`` naming both; registering the same object again (or a new version of the same
qualified name, as a module reload does) replaces the entry.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """A name no entry has; a ``KeyError`` and a ``ValueError`` so callers may catch either."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


@dataclass(frozen=True)
class RegistryEntry(Generic[T]):
    name: str
    obj: T
    meta: dict[str, Any] = field(default_factory=dict)


class Registry(Generic[T]):
    """``name -> (object, metadata)`` with lazy built-ins and entry-point plugins."""

    def __init__(
        self,
        kind: str,
        *,
        builtin_modules: tuple[str, ...] = (),
        entry_point_group: Optional[str] = None,
    ):
        self.kind = kind
        self.builtin_modules = builtin_modules
        self.entry_point_group = entry_point_group
        self._entries: dict[str, RegistryEntry[T]] = {}
        self._loaded = False
        self.plugin_errors: dict[str, str] = {}
        """Entry points that failed to load: name -> error message."""

    # ------------------------------------------------------------------ writing
    def add(self, name: str, obj: T, **meta: Any) -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"{self.kind} registry: a name must be a non-empty string, got {name!r}"
            )
        old = self._entries.get(name)
        if (
            old is not None
            and old.obj is not obj
            and qualified_name(old.obj) != qualified_name(obj)
        ):
            raise ValueError(
                f"{self.kind} {name!r} is already registered by "
                f"{qualified_name(old.obj)}; cannot register "
                f"{qualified_name(obj)} under the same name"
            )
        self._entries[name] = RegistryEntry(name, obj, dict(meta))
        return obj

    def register(self, name: str, **meta: Any) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""

        def deco(obj: T) -> T:
            return self.add(name, obj, **meta)

        return deco

    # ------------------------------------------------------------------ reading
    def load(self) -> None:
        """Import the built-in modules and the installed plugins (once)."""
        if self._loaded:
            return
        self._loaded = True
        for mod in self.builtin_modules:
            importlib.import_module(mod)
        if self.entry_point_group:
            for ep in importlib_metadata.entry_points(group=self.entry_point_group):
                self._load_entry_point(ep)

    def _load_entry_point(self, ep: Any) -> None:
        try:
            obj = ep.load()
        except Exception as e:  # a broken plugin must not break the others
            msg = f"{type(e).__name__}: {e}"
            self.plugin_errors[ep.name] = msg
            logger.warning(
                "%s plugin %r (%s) failed to load and is skipped: %s",
                self.kind,
                ep.name,
                ep.value,
                msg,
            )
            return
        if ep.name not in self._entries:  # a module that registered itself keeps its meta
            self.add(ep.name, obj, plugin=ep.value)

    def get(self, name: str) -> T:
        return self.entry(name).obj

    def entry(self, name: str) -> RegistryEntry[T]:
        self.load()
        try:
            return self._entries[name]
        except KeyError:
            hint = ""
            if name in self.plugin_errors:
                hint = f" (its plugin failed to load: {self.plugin_errors[name]})"
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}{hint}; registered: {sorted(self._entries)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        self.load()
        return name in self._entries

    def names(self) -> list[str]:
        self.load()
        return sorted(self._entries)

    def entries(self) -> Iterator[RegistryEntry[T]]:
        """Entries in registration order."""
        self.load()
        return iter(list(self._entries.values()))

    def remove(self, name: str) -> None:
        """Drop an entry (tests that register throw-away objects)."""
        self._entries.pop(name, None)
