"""Build and load a project C++ kernel library with plain g++, cached per machine: a ctypes
library (:class:`NativeLibrary`) or a torch op library (:class:`TorchOpLibrary`).

Used by every hand-written CPU kernel (the fused paged attention in ``backends/attention``,
the small-M linears in ``passes``): one :class:`NativeLibrary` per source file; the kernels'
torch ops (``TORCH_LIBRARY_IMPL`` kernels of ``piecewise::`` ops, ``passes/csrc/torch_ops.cpp``)
are one :class:`TorchOpLibrary`, built with torch's headers and loaded with
``torch.ops.load_library``, so the graph's op calls reach C++ without a Python op body.

Why plain g++ rather than ``torch.utils.cpp_extension``: one compiler call, no setuptools or
ninja, and one cache with atomic publication for both kinds.  The kernels themselves need no
torch headers (they work on data pointers), so a ctypes library builds in ~1-2 s; the torch
op library compiles torch's headers once per machine and torch version (~20 s on this
project's 2-core machines, quiet; cached in the kernel directory like the rest).  Per call, a
ctypes call costs ~3 µs, but reaching it from a graph also costs the op's Python body
(reshapes, checks, ``data_ptr`` s): ~32 µs per call on a 64x64 bf16 linear against ~12 µs for
the C++ op kernel, under load (``python -m experiments.bench.op_overhead``).

The build is per machine: ``-O3 -march=native`` lets the compiler vectorise for this CPU
(AVX-512 on the project's EPYC machines), so the cache key holds the source hash, the
compiler's identity, the flags and the CPU's feature flags.  If the native build fails (a
compiler without ``-march=native``), the portable ``-O3`` build is used; the library's
``portable_env`` variable (e.g. ``PIECEWISE_CPU_PAGED_PORTABLE=1``) forces it.  Libraries
live under ``$PIECEWISE_CACHE_DIR/kernels`` (default ``~/.cache/piecewise/kernels``), written
to a temporary name and renamed, so concurrent builders never load a half-written file.

Threads: the libraries are built with ``-fopenmp`` and link ``libgomp.so.1`` by soname, which
resolves to the copy torch already loaded, so ``torch.set_num_threads`` governs them and no
second thread pool exists.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import types
import warnings
from pathlib import Path
from typing import Callable, Optional

from framework.core.files import (
    atomic_write,
    default_cache_root,
    is_environment_error,
    sweep_stale_temps,
)

NATIVE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
MARCH_NATIVE = "-march=native"
PORTABLE_FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-shared", "-fPIC")


class KernelBuildError(RuntimeError):
    """A native kernel library could not be built or loaded."""


def compiler() -> str | None:
    """Path of the C++ compiler (``$CXX`` or g++), None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


@functools.lru_cache(maxsize=None)
def cpu_flags() -> str:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; the processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernel_dir() -> Path:
    return default_cache_root() / "kernels"


def _compiler_identity(cxx: str) -> str:
    """The compiler's resolved path, size and mtime: changes with any compiler upgrade, and
    costs a stat rather than a ``--version`` subprocess on every process start."""
    real = os.path.realpath(cxx)
    st = os.stat(real)
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


class NativeLibrary:
    """One C++ source file built into ``lib<name>.so`` and loaded through ctypes.

    ``declare(lib)`` sets the ``argtypes``/``restype`` of the library's C functions after each
    load; ``portable_env`` names the environment variable that forces the portable build;
    ``extra_flags`` are added to both builds (e.g. ``-ffp-contract=off`` where a kernel must
    round as torch does); ``depends`` are further source files the build reads (``#include``
    d), hashed into the build key with ``source``.
    """

    def __init__(
        self,
        name: str,
        source: Path,
        *,
        portable_env: str,
        declare: Callable[[ctypes.CDLL], None],
        extra_flags: tuple[str, ...] = (),
        depends: tuple[Path, ...] = (),
    ) -> None:
        self.name = name
        self.source = Path(source)
        self.portable_env = portable_env
        self._declare = declare
        self.extra_flags = tuple(extra_flags)
        self.depends = tuple(Path(d) for d in depends)
        self.load = functools.lru_cache(maxsize=None)(self._load)

    def __repr__(self) -> str:
        return f"NativeLibrary({self.name!r}, {str(self.source)!r})"

    def relocated(self, name: str, old_root: Path, new_root: Path) -> "NativeLibrary":
        """The same library (flags, declarations) built as ``lib<name>.so`` from the copies of
        its source and ``depends`` under ``new_root`` that sit where they sit under
        ``old_root`` (e.g. a checkout of another revision: A/B benchmarks of a kernel)."""

        def moved(path: Path) -> Path:
            return Path(new_root) / path.resolve().relative_to(Path(old_root).resolve())

        return NativeLibrary(
            name,
            moved(self.source),
            portable_env=self.portable_env,
            declare=self._declare,
            extra_flags=self.extra_flags,
            depends=tuple(moved(d) for d in self.depends),
        )

    def build_key(self, cxx: str, flags: tuple[str, ...]) -> str:
        h = hashlib.sha256()
        for part in (
            self.source.read_bytes(),
            *(d.read_bytes() for d in self.depends),
            _compiler_identity(cxx).encode(),
            " ".join(flags).encode(),
            cpu_flags().encode() if MARCH_NATIVE in flags else b"",
            platform.machine().encode(),
            self._toolchain_identity().encode(),
        ):
            h.update(part)
            h.update(b"\0")
        return h.hexdigest()[:20]

    def _toolchain_identity(self) -> str:
        """What else the build depends on (a torch op library: torch's version)."""
        return ""

    def _link_flags(self) -> tuple[str, ...]:
        """Flags after the source on the command line (libraries to link)."""
        return ()

    def _flag_sets(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(native, portable) compiler flags."""
        return NATIVE_FLAGS + self.extra_flags, PORTABLE_FLAGS + self.extra_flags

    def _compile(self, cxx: str, flags: tuple[str, ...], target: Path) -> None:
        def build(tmp: Path) -> None:
            proc = subprocess.run(
                [cxx, *flags, str(self.source), *self._link_flags(), "-o", str(tmp)],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise KernelBuildError(
                    f"{cxx} failed to build {self.source.name} with "
                    f"{' '.join(flags)}:\n{proc.stderr[-2000:]}"
                )

        sweep_stale_temps(target.parent)
        atomic_write(target, build)

    def _build_unshared(self, cxx: str, flags: tuple[str, ...], target: Path, err: OSError):
        """The kernel cache cannot be written (full or read-only disk): build into a private
        temp directory for this process, with one warning naming the directory and error."""
        warnings.warn(
            f"piecewise: cannot write the native kernel cache {target.parent} ({err}); "
            f"building lib{self.name}.so in a temp directory for this process only",
            stacklevel=3,
        )
        private = Path(tempfile.mkdtemp(prefix=f"piecewise-{self.name}-")) / target.name
        self._compile(cxx, flags, private)
        return private

    def portable_forced(self) -> bool:
        return os.environ.get(self.portable_env, "") not in ("", "0")

    def library_path(self, portable: Optional[bool] = None) -> Path:
        """The cached library for this machine, building it on first use."""
        cxx = compiler()
        if cxx is None:
            raise KernelBuildError(
                f"no C++ compiler found (${{CXX}} or g++ on PATH) to build {self.source.name}"
            )
        if portable is None:
            portable = self.portable_forced()
        native, portable_flags = self._flag_sets()
        candidates = [portable_flags] if portable else [native, portable_flags]
        errors = []
        for flags in candidates:
            target = (
                kernel_dir() / f"{self.name}-{self.build_key(cxx, flags)}" / f"lib{self.name}.so"
            )
            if target.exists():
                return target
            try:
                try:
                    self._compile(cxx, flags, target)
                except OSError as e:
                    if not is_environment_error(e):
                        raise
                    return self._build_unshared(cxx, flags, target, e)
                return target
            except KernelBuildError as e:
                errors.append(str(e))
        raise KernelBuildError("\n".join(errors))

    def _load(self, portable: Optional[bool] = None) -> ctypes.CDLL:
        """Load (building if needed) the library and declare its C signatures; cached per
        ``portable`` value (call as ``lib.load()``)."""
        path = self.library_path(portable)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise KernelBuildError(f"cannot load {path}: {e}") from e
        self._declare(lib)
        return lib


class TorchOpLibrary(NativeLibrary):
    """One C++ source file registering kernels of torch ops (``TORCH_LIBRARY_IMPL``), built
    against the running torch's headers and libraries and loaded with
    ``torch.ops.load_library`` (registration happens as the library is loaded).  The build key
    adds torch's version; the cache, the portable variant and atomic publication are
    :class:`NativeLibrary`'s.  Compiling torch's headers takes tens of seconds on a 2-core
    machine, once per machine and torch version (the kernel cache keeps the result).

    Load it once per process (``load()``): a second variant would register the same kernels
    again.

    ``python_module``: the library is also a Python extension module of that name (the source
    defines ``PYBIND11_MODULE(PW_PYTHON_MODULE, m)`` under ``#ifdef PW_PYTHON_MODULE``),
    built where this Python's headers are installed, with its ABI in the build key;
    :meth:`python_module` imports it from the loaded file.  Its functions call the op kernels
    directly: a 64x64 bf16 linear from Python ~1.4 µs a call (~1.7 with ``direct_call``'s
    checks) against ~2.6-2.8 µs through the dispatcher (``experiments.bench.op_overhead``),
    which a lean piece's dozens of op calls a decode step pay.  Where the build with the
    module fails, or the module does not import, the library goes on without it (one
    warning): the kernels are what matters."""

    def __init__(
        self,
        name: str,
        source: Path,
        *,
        portable_env: str,
        extra_flags: tuple[str, ...] = (),
        depends: tuple[Path, ...] = (),
        python_module: Optional[str] = None,
    ) -> None:
        super().__init__(
            name,
            source,
            portable_env=portable_env,
            declare=lambda lib: None,
            extra_flags=extra_flags,
            depends=depends,
        )
        self.python_module_name = python_module
        self._python_off = False
        """Set where the build with the Python module failed (then built without it)."""
        self._loaded_path: Optional[Path] = None
        self._module: Optional[types.ModuleType] = None

    @staticmethod
    def _python_include() -> Optional[Path]:
        """This Python's C headers, or None where they are not installed."""
        import sysconfig

        inc = sysconfig.get_paths().get("include")
        return Path(inc) if inc and (Path(inc) / "Python.h").is_file() else None

    def _binds_python(self) -> bool:
        return (
            self.python_module_name is not None
            and not self._python_off
            and self._python_include() is not None
        )

    @staticmethod
    def _torch_dirs() -> tuple[Path, list[Path]]:
        import torch

        root = Path(torch.__file__).resolve().parent
        return root / "lib", [
            root / "include",
            root / "include" / "torch" / "csrc" / "api" / "include",
        ]

    def _toolchain_identity(self) -> str:
        import sysconfig

        import torch

        identity = f"torch {torch.__version__} {torch.version.git_version}"
        if self._binds_python():
            identity += f" python {sysconfig.get_config_var('SOABI')}"
        return identity

    def _flag_sets(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        import torch

        _, includes = self._torch_dirs()
        common = (
            *self.extra_flags,
            *(f"-I{p}" for p in includes),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        )
        if self._binds_python():
            common += (
                f"-I{self._python_include()}",
                f"-DPW_PYTHON_MODULE={self.python_module_name}",
            )
        return NATIVE_FLAGS + common, PORTABLE_FLAGS + common

    def _link_flags(self) -> tuple[str, ...]:
        lib, _ = self._torch_dirs()
        python = ("-ltorch_python",) if self._binds_python() else ()
        return (f"-L{lib}", "-lc10", "-ltorch_cpu", *python, f"-Wl,-rpath,{lib}")

    def python_module(self) -> Optional[types.ModuleType]:
        """The loaded library as a Python module (see the class docstring), or None where it
        was built without one (no Python headers) or is not loaded."""
        if not self._binds_python() or self._loaded_path is None:
            return None
        if self._module is None:
            import importlib.machinery
            import importlib.util

            name = self.python_module_name
            loader = importlib.machinery.ExtensionFileLoader(name, str(self._loaded_path))
            spec = importlib.util.spec_from_loader(name, loader)
            try:
                if spec is None:
                    raise ImportError(f"no module spec for {self._loaded_path}")
                module = importlib.util.module_from_spec(spec)
                loader.exec_module(module)
            except (ImportError, OSError) as e:  # the kernels stay registered: go without it
                logging.getLogger(__name__).warning(
                    "piecewise: lib%s loaded, its Python module not: %s", self.name, e
                )
                self._python_off = True
                return None
            self._module = module
        return self._module

    def register(self, fallback: str, direct: tuple[str, ...] = ()) -> bool:
        """Load (building if needed) the default variant, registering its kernels; False,
        with one warning that ``fallback`` runs instead, where there is no compiler or the
        library cannot be built.  The ops must be defined first.  ``direct``: qualified names
        (``piecewise::<op>``) of ops whose kernels the Python module exports under the op's
        name; where the module loads, each becomes the op's direct call
        (``framework.core.ops.set_direct_call``), and the module's ``<op>_record``, where it
        has one, the op's recording direct kernel (``set_direct_recorder``)."""
        if compiler() is None:
            return False
        log = logging.getLogger(__name__)
        try:
            self.load()
        except KernelBuildError as e:
            if not self._binds_python():
                log.warning("piecewise: lib%s unavailable, %s: %s", self.name, fallback, e)
                return False
            # The kernels matter, their Python module does not: once more without it.
            log.warning("piecewise: lib%s built without its Python module: %s", self.name, e)
            self._python_off = True
            return self.register(fallback, direct)
        module = self.python_module() if direct else None
        if module is not None:  # the same kernels, callable without the dispatcher
            from framework.core.ops import set_direct_call, set_direct_recorder  # (imports torch)

            for qualname in direct:
                name = qualname.split("::", 1)[1]
                set_direct_call(qualname, getattr(module, name))
                recorder = getattr(module, f"{name}_record", None)
                if recorder is not None:  # the call and the native call it made (replay)
                    set_direct_recorder(qualname, recorder)
        return True

    def _load(self, portable: Optional[bool] = None):  # type: ignore[override]
        """Load (building if needed) the library: its kernels are registered from then on.
        Returns the library's path."""
        import torch

        path = self.library_path(portable)
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as e:
            raise KernelBuildError(f"cannot load {path}: {e}") from e
        self._loaded_path = path
        return path
