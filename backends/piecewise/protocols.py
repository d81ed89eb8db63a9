"""What the piecewise compile backend needs from the layers it drives, as Protocols it owns.

The backend sits *above* the artifact cache (``framework.cache``) and the passes (``passes``)
in the import contract, yet imports neither: the compile spine's builder
(``framework.compile.build``) hands it an :class:`framework.cache.store.ArtifactStore` as a
:class:`PieceStore` and a :class:`passes.manager.PassManager` as a :class:`PieceGraphPass`.
Anything else that implements these (a test double, another cache) plugs in the same way;
``tests/backends/piecewise/test_protocols.py`` checks that the real ones conform.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, ContextManager, Optional, Protocol, runtime_checkable

import torch

from framework.core.compile_range import CompileRange


@runtime_checkable
class PieceStore(Protocol):
    """An on-disk artifact store scoped to one cache key, rank and model tag."""

    @property
    def dir(self) -> Path:
        """The folder that holds this store's index, artifacts and blobs."""
        ...

    def lock(self) -> ContextManager[object]:
        """An inter-process lock held for a whole cold compile."""
        ...

    def lookup(self, entry_key: str, graph_hash: str | None = None) -> Optional[Path]:
        """The verified artifact file of ``entry_key`` (or of an identical graph), or None."""
        ...

    def store(self, entry_key: str, graph_hash: str, write: Callable[[Path], None]) -> Path:
        """Write an artifact (``write(path)`` fills a temp file) and index it atomically."""
        ...

    def link(self, entry_key: str, graph_hash: str) -> Optional[Path]:
        """Point ``entry_key`` at the stored artifact of an identical graph, if any."""
        ...

    def discard(self, entry_key: str, reason: str) -> None:
        """Drop an entry that exists but cannot be used (warned with ``reason``)."""
        ...

    def store_blob(self, name: str, data: bytes) -> Path:
        """A named, checksummed side file (the program skeleton)."""
        ...

    def load_blob(self, name: str) -> Optional[bytes]:
        """A blob written by :meth:`store_blob`, or None when missing or damaged."""
        ...


@runtime_checkable
class PieceGraphPass(Protocol):
    """The pass pipeline the compiler adaptors run on every piece, with the backend's hooks.

    The adaptors call it on a post-grad ``torch.fx.Graph`` (Inductor's custom post-pass) or,
    for the eager adaptor, through :meth:`run_on_graph_module`; ``uuid()`` enters Inductor's
    cache key.  The backend tells it which piece and range is being compiled next and, after
    each (piece, range), where the code came from.
    """

    @property
    def must_run(self) -> bool:
        """True while verifying or dumping: every piece must be compiled, nothing loaded."""
        ...

    def __call__(self, graph: torch.fx.Graph) -> None: ...

    def uuid(self) -> Optional[str]: ...

    def run_on_graph_module(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule: ...

    def set_current_piece(
        self,
        piece_name: str,
        compile_range: Optional[CompileRange] = None,
        static_inputs: Optional[dict[int, torch.Tensor]] = None,
    ) -> None: ...

    def piece_done(
        self,
        piece_name: str,
        compile_range: Optional[CompileRange],
        source: str,
        shared_with: Optional[str] = None,
    ) -> None:
        """``source``: ``compiled``, ``shared`` (same code as ``shared_with``) or ``loaded``."""
        ...
