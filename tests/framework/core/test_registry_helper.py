"""The one registry helper: decorator registration, lazy built-ins, one duplicate policy,
entry-point plugins (a broken one is reported by name and skipped)."""

import logging
from importlib import metadata

import pytest

from framework.core.registry import Registry, UnknownNameError


def test_register_get_and_meta():
    reg = Registry("widget")

    @reg.register("a", order=1)
    def a():
        return 1

    assert reg.get("a") is a and reg.entry("a").meta == {"order": 1}
    assert "a" in reg and reg.names() == ["a"]


def test_unknown_name_lists_registered_and_is_key_and_value_error():
    reg = Registry("widget")
    reg.add("b", object())
    with pytest.raises(KeyError, match=r"unknown widget 'zzz'; registered: \['b'\]"):
        reg.get("zzz")
    with pytest.raises(ValueError):
        reg.get("zzz")
    assert issubclass(UnknownNameError, KeyError)


def test_one_duplicate_policy():
    reg = Registry("widget")

    def f():
        pass

    reg.add("f", f)
    reg.add("f", f)  # the same object again: fine
    with pytest.raises(ValueError, match="already registered by .*f; cannot register .*g"):

        def g():
            pass

        reg.add("f", g)
    # A re-import of the same definition (same qualified name, new object) replaces it.
    exec_ns: dict = {}
    exec("def f():\n    return 2\n", {"__name__": f.__module__}, exec_ns)
    new_f = exec_ns["f"]
    new_f.__qualname__ = f.__qualname__
    reg.add("f", new_f)
    assert reg.get("f") is new_f


def test_builtin_modules_load_lazily():
    reg = Registry("widget", builtin_modules=("json",))
    assert not reg._loaded
    reg.names()
    assert reg._loaded


class _FakeEntryPoint:
    """importlib.metadata.EntryPoint stand-in (the real plugin path through an installed
    package is tested with a real pip install in tests/experiments)."""

    def __init__(self, name, value, obj=None, error=None):
        self.name, self.value, self._obj, self._error = name, value, obj, error

    def load(self):
        if self._error:
            raise self._error
        return self._obj


def test_entry_points_load_and_a_broken_plugin_is_skipped(monkeypatch, caplog):
    good = object()
    eps = [
        _FakeEntryPoint("good", "pkg.mod:good", good),
        _FakeEntryPoint("broken", "pkg.bad:x", error=ImportError("no module named pkg.bad")),
    ]
    monkeypatch.setattr(
        metadata, "entry_points", lambda group: eps if group == "piecewise.widgets" else []
    )
    reg = Registry("widget", entry_point_group="piecewise.widgets")
    with caplog.at_level(logging.WARNING):
        assert reg.get("good") is good
    assert "broken" in caplog.text and "no module named pkg.bad" in caplog.text
    assert reg.plugin_errors == {"broken": "ImportError: no module named pkg.bad"}
    with pytest.raises(KeyError, match="its plugin failed to load"):
        reg.get("broken")
