"""Which of our modules define a class: the class's own module and its bases' (outside torch
and the stdlib). The pass cache key hashes their live code (``passes.code_hash``); the model's
cache key hashes their files (``framework.compile.build``). One walker for both."""

from __future__ import annotations

import inspect
import sys
from typing import Iterable

_SKIPPED_TOP_LEVEL = ("torch", "abc", "typing")


def class_modules(cls: type) -> list[str]:
    """Modules of ``cls`` and of every base class outside torch and the stdlib, in MRO order: a
    class's behaviour changes when its own module *or* a base it inherits changes."""
    modules = []
    for klass in cls.__mro__:
        module = klass.__module__ or ""
        if (
            module == "builtins"
            or module.split(".")[0] in _SKIPPED_TOP_LEVEL
            or module not in sys.modules
        ):
            continue
        if module not in modules:
            modules.append(module)
    return modules


def class_source_files(classes: Iterable[type]) -> list[str]:
    """Sorted source files of :func:`class_modules` of every class (modules without a source
    file, e.g. built-in extensions, are left out)."""
    files = set()
    for cls in set(classes):
        for module in class_modules(cls):
            try:
                files.add(inspect.getsourcefile(sys.modules[module]))
            except TypeError:
                pass
    return sorted(f for f in files if f)
