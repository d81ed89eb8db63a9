"""Version facts and the one-warning rule shared by the compat modules."""

from __future__ import annotations

import logging
import threading

import torch

CHECKED_ON = ("2.11.0", "2.13.0")
"""torch releases every function of :mod:`framework.compat` was run on (CI: 2.13.0 in the main
venv, 2.11.0 in the GPU-image stage).  ``pyproject.toml`` declares ``torch>=2.11,<2.15``."""

logger = logging.getLogger("framework.compat")


class Unavailable(RuntimeError):
    """A private torch API this code needs is missing in the installed torch."""

    def __init__(self, api: str, detail: str = ""):
        super().__init__(
            f"{api} is not available in torch {torch.__version__} (checked on "
            f"{', '.join(CHECKED_ON)}){': ' + detail if detail else ''}"
        )
        self.api = api


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


class _OnceRegistry:
    """Features already reported as disabled in this process (each is warned about once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, str] = {}

    def first(self, feature: str, reason: str) -> bool:
        with self._lock:
            if feature in self._seen:
                return False
            self._seen[feature] = reason
            return True

    def disabled(self) -> dict[str, str]:
        with self._lock:
            return dict(self._seen)


_REGISTRY = _OnceRegistry()


def warn_once(feature: str, reason: str) -> None:
    """Report, once per process, that the optional path ``feature`` is off on this torch."""
    if _REGISTRY.first(feature, reason):
        msg = (
            f"{feature} disabled on torch {torch.__version__}: {reason} "
            f"(checked on {', '.join(CHECKED_ON)}); the public path is used instead"
        )
        logger.warning(msg)


def disabled_features() -> dict[str, str]:
    """The optional paths switched off in this process, with the reason (for tests, stats)."""
    return _REGISTRY.disabled()
