"""``framework.core.page_cache``: the fraction of a file the page cache holds, read without
touching it.  The files here are evicted with ``posix_fadvise(DONTNEED)`` and read back in
part with readahead off, so the expected fractions are known."""

from __future__ import annotations

import mmap
import os
import sys
import time

import pytest

from framework.core.page_cache import (
    PAGE,
    evict,
    evict_tree,
    file_resident_fraction,
    read_ahead,
    resident_fraction,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2)")

PAGES = 256


def _evicted(path) -> bool:
    """False where the filesystem keeps the pages (tmpfs holds its files only there)."""
    return evict(path) == 0.0


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(PAGES * PAGE))
    return path


def test_a_file_just_written_is_held_and_an_evicted_one_is_not(data_file):
    assert file_resident_fraction(data_file) == 1.0
    if not _evicted(data_file):
        pytest.skip(f"{data_file.parent}: this filesystem keeps pages after DONTNEED")
    # Asking does not read: the answer stays 0 however often it is asked.
    assert file_resident_fraction(data_file) == 0.0


def test_the_fraction_counts_the_pages_read(data_file):
    if not _evicted(data_file):
        pytest.skip(f"{data_file.parent}: this filesystem keeps pages after DONTNEED")
    fd = os.open(data_file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: only what is read
        for page in range(0, PAGES, 4):  # every fourth page
            os.pread(fd, 1, page * PAGE)
    finally:
        os.close(fd)
    assert file_resident_fraction(data_file) == pytest.approx(0.25, abs=0.03)


def test_a_mapped_range_reports_its_own_pages(data_file):
    with open(data_file, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        import ctypes

        anchor = ctypes.c_char.from_buffer(m)
        address = ctypes.addressof(anchor)
        assert resident_fraction(address, PAGES * PAGE) == 1.0
        assert resident_fraction(address + 1, PAGE) is None  # not page-aligned
        assert resident_fraction(address, 0) is None
        del anchor
    finally:
        m.close()


def test_unknown_answers_are_none(tmp_path):
    assert file_resident_fraction(tmp_path / "absent.bin") is None
    (tmp_path / "empty.bin").write_bytes(b"")
    assert file_resident_fraction(tmp_path / "empty.bin") is None
    assert file_resident_fraction(tmp_path) is None  # a directory
    assert evict(tmp_path / "absent.bin") is None


def test_evict_tree_drops_every_file_under_folders_and_named_files(tmp_path):
    a, deep, b, c = (tmp_path / p for p in ("a/x.bin", "a/deep/y.bin", "b.bin", "c.bin"))
    for f in (a, deep, b, c):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"\1" * (1 << 16))
    assert all(file_resident_fraction(f) == 1.0 for f in (a, deep, b, c))
    kept = evict_tree(tmp_path / "a", c, tmp_path / "absent")
    if kept:
        pytest.skip(f"{tmp_path}: this filesystem keeps pages after DONTNEED")
    assert [file_resident_fraction(f) for f in (a, deep, b, c)] == [0.0, 0.0, 1.0, 0.0]


def test_read_ahead_brings_the_whole_file_in_on_a_thread(data_file):
    """Chunk by chunk (small chunks here: every one a separate request), so the whole file
    is read, not only the first window the kernel reads ahead per call."""
    if not _evicted(data_file):
        pytest.skip(f"{data_file.parent}: this filesystem keeps pages after DONTNEED")
    thread = read_ahead(data_file, chunk=4 * PAGE)
    thread.join(timeout=30)
    assert not thread.is_alive() and thread.daemon
    # the requests are queued; a page counts once its read has completed
    deadline = time.monotonic() + 30
    while file_resident_fraction(data_file) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert file_resident_fraction(data_file) == 1.0
    read_ahead(data_file.parent / "absent.bin").join(timeout=30)  # nothing to read: no error
