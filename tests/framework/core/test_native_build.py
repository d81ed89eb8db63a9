"""framework.core.native_build: one g++ + ctypes build per (source, compiler, flags, CPU),
cached on disk, the portable build forced by the library's variable, errors that name the
source."""

import ctypes

import pytest

from framework.core import native_build as nb

pytestmark = pytest.mark.skipif(nb.compiler() is None, reason="needs a C++ compiler")

SOURCE = """
#include <cstdint>
extern "C" int64_t twice(int64_t x) { return 2 * x; }
extern "C" const char* isa() {
#if defined(__AVX2__)
  return "native";
#else
  return "portable";
#endif
}
"""


def _declare(lib):
    lib.twice.argtypes = [ctypes.c_int64]
    lib.twice.restype = ctypes.c_int64
    lib.isa.restype = ctypes.c_char_p


@pytest.fixture
def library(tmp_path, monkeypatch):
    monkeypatch.setenv("PIECEWISE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "twice.cpp"
    src.write_text(SOURCE)
    return nb.NativeLibrary("twice", src, portable_env="PW_TEST_PORTABLE", declare=_declare)


def test_builds_once_loads_and_declares(library, tmp_path):
    lib = library.load()
    assert lib.twice(21) == 42
    assert library.load() is lib  # loaded once per process
    path = library.library_path()
    assert path.parent.parent == tmp_path / "cache" / "kernels"
    assert path.name == "libtwice.so" and path.parent.name.startswith("twice-")
    mtime = path.stat().st_mtime_ns
    assert library.library_path() == path and path.stat().st_mtime_ns == mtime  # not rebuilt


def test_key_follows_source_and_flags(library):
    cxx = nb.compiler()
    native = library.build_key(cxx, nb.NATIVE_FLAGS)
    assert native != library.build_key(cxx, nb.PORTABLE_FLAGS)
    library.source.write_text(SOURCE + "\n// changed\n")
    assert library.build_key(cxx, nb.NATIVE_FLAGS) != native


def test_portable_build_forced_by_its_variable(library, monkeypatch):
    native_path = library.library_path()
    monkeypatch.setenv("PW_TEST_PORTABLE", "1")
    portable_path = library.library_path()
    assert portable_path != native_path
    assert library.load(portable=True).isa() == b"portable"
    monkeypatch.setenv("PW_TEST_PORTABLE", "0")
    assert library.library_path() == native_path


def test_errors_name_the_source(library, monkeypatch):
    library.source.write_text("this is not C++")
    with pytest.raises(nb.KernelBuildError, match="failed to build twice.cpp"):
        library.library_path()
    assert not any(p.suffix == ".so" for p in nb.kernel_dir().rglob("*"))  # no half-written file
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(nb.KernelBuildError, match="no C\\+\\+ compiler .* twice.cpp"):
        library.library_path()


def test_cpu_flags_are_in_the_native_key_only(library, monkeypatch):
    cxx = nb.compiler()
    keys = (library.build_key(cxx, nb.NATIVE_FLAGS), library.build_key(cxx, nb.PORTABLE_FLAGS))
    monkeypatch.setattr(nb, "cpu_flags", lambda: "a-different-cpu")
    assert library.build_key(cxx, nb.NATIVE_FLAGS) != keys[0]
    assert library.build_key(cxx, nb.PORTABLE_FLAGS) == keys[1]


def test_a_relocated_library_builds_the_copy_under_its_new_root(tmp_path, monkeypatch):
    """``relocated``: the same library from copies of its source and headers under another
    root (another revision's checkout), built and loaded beside the original."""
    monkeypatch.setenv("PIECEWISE_CACHE_DIR", str(tmp_path / "cache"))
    old, new = tmp_path / "old", tmp_path / "new"
    for root, factor in ((old, 2), (new, 3)):
        (root / "csrc").mkdir(parents=True)
        (root / "csrc" / "factor.h").write_text(f"constexpr int64_t kFactor = {factor};\n")
        (root / "csrc" / "twice.cpp").write_text(
            '#include <cstdint>\n#include "factor.h"\n'
            'extern "C" int64_t twice(int64_t x) { return kFactor * x; }\n'
            'extern "C" const char* isa() { return "x"; }\n'
        )
    original = nb.NativeLibrary(
        "twice",
        old / "csrc" / "twice.cpp",
        portable_env="PW_TEST_PORTABLE",
        declare=_declare,
        extra_flags=("-DUNUSED=1",),
        depends=(old / "csrc" / "factor.h",),
    )
    moved = original.relocated("twice_other", old, new)
    assert moved.source == new / "csrc" / "twice.cpp"
    assert moved.depends == (new / "csrc" / "factor.h",) and moved.extra_flags == ("-DUNUSED=1",)
    assert original.load().twice(7) == 14 and moved.load().twice(7) == 21  # both, declared
    assert moved.library_path().name == "libtwice_other.so"
