"""Build and load the fused CPU paged-attention library (``csrc/cpu_paged_attention.cpp``).

Why plain g++ + ctypes rather than ``torch.utils.cpp_extension``: the kernel needs no torch
headers (it works on data pointers), so one g++ call builds it in ~1-2 s, against ~40-60 s
for a C++ extension on this project's 2-core machines (that would eat CI's test budget on a
fresh cache).  A ctypes call with the kernel's 25 arguments costs ~3 µs here, about one torch
op dispatch (``x.add_(1)`` measures 4.5-5 µs), so nothing is lost per call; the op users see is
still ``piecewise::attention``.

The build is per machine: ``-O3 -march=native`` lets the compiler vectorise for this CPU
(AVX-512 on the project's EPYC machines), so the cache key holds the source hash, the
compiler's identity, the flags and the CPU's feature flags.  If the native build fails (a
compiler without ``-march=native``), the portable ``-O3`` build is used;
``PIECEWISE_CPU_PAGED_PORTABLE=1`` forces it.  Libraries live under
``$PIECEWISE_CACHE_DIR/kernels`` (default ``~/.cache/piecewise/kernels``), written to a
temporary name and renamed, so concurrent builders never load a half-written file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_paged_attention.cpp"
NATIVE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
PORTABLE_FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-shared", "-fPIC")


class KernelBuildError(RuntimeError):
    """The fused CPU attention library could not be built or loaded."""


def compiler() -> str | None:
    """Path of the C++ compiler (``$CXX`` or g++), None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


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
    root = os.environ.get("PIECEWISE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "piecewise"
    )
    return Path(root) / "kernels"


def _compiler_identity(cxx: str) -> str:
    """The compiler's resolved path, size and mtime: changes with any compiler upgrade, and
    costs a stat rather than a ``--version`` subprocess on every process start."""
    real = os.path.realpath(cxx)
    st = os.stat(real)
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def build_key(cxx: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        _compiler_identity(cxx).encode(),
        " ".join(flags).encode(),
        cpu_flags().encode() if "-march=native" in flags else b"",
        platform.machine().encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def _compile(cxx: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cxx, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise KernelBuildError(
                f"{cxx} failed to build {SOURCE.name} with "
                f"{' '.join(flags)}:\n{proc.stderr[-2000:]}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path(portable: bool | None = None) -> Path:
    """The cached library for this machine, building it on first use."""
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError(
            f"no C++ compiler found (${{CXX}} or g++ on PATH) to build "
            f"{SOURCE.name}; use attention_backend='torch'"
        )
    if portable is None:
        portable = os.environ.get("PIECEWISE_CPU_PAGED_PORTABLE", "") not in ("", "0")
    candidates = [PORTABLE_FLAGS] if portable else [NATIVE_FLAGS, PORTABLE_FLAGS]
    errors = []
    for flags in candidates:
        target = kernel_dir() / f"cpu_paged-{build_key(cxx, flags)}" / "libcpu_paged.so"
        if target.exists():
            return target
        try:
            _compile(cxx, flags, target)
            return target
        except KernelBuildError as e:
            errors.append(str(e))
    raise KernelBuildError("\n".join(errors))


@functools.lru_cache(maxsize=None)
def load_library(portable: bool | None = None) -> ctypes.CDLL:
    """Load (building if needed) the library and declare its C signatures."""
    path = library_path(portable)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from e
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.piecewise_cpu_paged_attention
    fn.argtypes = (
        [p, i64, p, i64, p, i64, p, i64, p, i64, i64, p, p, i64, p, p]
        + [i64] * 6
        + [ctypes.c_float, i64, i64]
    )
    fn.restype = ctypes.c_int
    lib.piecewise_cpu_paged_isa.restype = ctypes.c_char_p
    return lib


def isa(portable: bool | None = None) -> str:
    """The instruction set the loaded build was vectorised for."""
    return load_library(portable).piecewise_cpu_paged_isa().decode()
