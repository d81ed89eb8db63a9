"""The processed-weights cache: a model's tensors *after* loading, quantization and re-layout,
saved once as a safetensors file next to the compile artifacts and memory-mapped on a warm
start (no read, no copy, no re-layout: the pages come from the page cache as the first step
touches them).

Layout: one :class:`~framework.cache.store.ArtifactStore` directory per key, as for compiled
pieces but in a folder of their own (``<root>/weights/<key>/rank_<r>/weights-<tag>/``; ``python
-m framework.cache ls <root>/weights`` lists them), whose ``factors.json`` says what the key
covers (:func:`weight_factors`: the checkpoint's identity, dtype, quantization, kernel settings
and passes, tensor parallelism, the processing code, torch and the CPU).  The store's one entry
:data:`ENTRY` is the file ``artifacts/processed_weights.bin`` (safetensors, every tensor
64-byte aligned, every tensor of 2 MB or more 2 MB aligned); the blob :data:`META_BLOB` holds
what the file was when written (size, inode, mtime, the sha256 of its header).

Huge pages: a decode step streams the re-laid-out weights, and 4 KB pages cost it (one TLB
entry per 4 KB; ``framework.core.huge_pages``).  The map is advised ``MADV_HUGEPAGE`` before
anything touches it, and the large tensors lie on 2 MB boundaries of the file, so where the
page cache holds a 2 MB folio of the file (Linux 6.x with large-folio page caches -- ext4 since
6.16, xfs -- writes them, and reads through an advised map fill them) the kernel maps it as one
huge page (``FilePmdMapped`` in ``/proc/self/smaps``): nothing copied, the page cache shared by
every process using the file.  The writer hands the file to the OS in pieces that end on 2 MB
boundaries (small tensors gathered), so the page cache builds its folios 2 MB wide, the small
weights' included: on the default tiny model 103 of 104 MB then map huge (55 of 98 MB written
tensor by tensor), and a warm start's decode step runs as fast as weights in anonymous huge
pages (``experiments/bench/results/weight_slabs_2026-12-05.md``).  Folios the page cache
already holds in 4 KB pieces stay so (collapsing file pages needs
``CONFIG_READ_ONLY_THP_FOR_FS``); such pages map as before.

Verification: the store records the file's sha256 (hashed once, when written).  A warm start does
not re-hash gigabytes: it checks that the file is the one written (size, inode and mtime as
recorded -- the mtime set back 10 s when written, so that any later write moves it -- and its
header's sha256); a file that changed since (rewritten, truncated, copied) is
hashed in full, and a mismatch is a :class:`CacheCorruptionWarning` naming the file, the entry
is dropped and the caller recomputes.  ``python -m framework.cache verify`` hashes every file.
A disk that refuses the write (full, read-only) is one :class:`CacheWriteWarning`; the model
runs from memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from framework.cache.files import file_sha256, is_environment_error, remove, tmp_path
from framework.cache.key import compute_cache_key, source_factors, tp_factors
from framework.cache.store import INDEX_FILE, ArtifactStore, CacheCorruptionWarning
from framework.core.huge_pages import HUGE_PAGE, MADV_HUGEPAGE, madvise
from framework.core.page_cache import file_resident_fraction, read_ahead

logger = logging.getLogger(__name__)

FORMAT = 2
"""Version of this file format and of the module-state description (a new key when bumped)."""
SUBDIR = "weights"
ENTRY = "processed_weights"
META_BLOB = "processed_weights.json"
ALIGN = 64
"""Every tensor's bytes start at a multiple of this many bytes from the start of the file (a
tensor of a huge page or more: at a multiple of the huge page)."""
BACKDATE_NS = 10 * 10**9

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
CODES = {v: k for k, v in DTYPES.items()}


class WeightFileError(ValueError):
    """A processed-weights file that does not parse (the message names the file)."""


# ----------------------------------------------------------------------------- file format
def _layout(
    tensors: Mapping[str, torch.Tensor], base: int
) -> tuple[dict[str, Any], list[tuple[int, Optional[torch.Tensor]]]]:
    """Header entries and the byte runs of the data, for data starting at file byte ``base``:
    each tensor at a multiple of :data:`ALIGN` from the start of the file, one of
    :data:`~framework.core.huge_pages.HUGE_PAGE` bytes or more at a multiple of that."""
    header: dict[str, Any] = {}
    order: list[tuple[int, Optional[torch.Tensor]]] = []
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in CODES:
            raise TypeError(f"processed weights: tensor {name!r} has dtype {t.dtype} (no code)")
        nbytes = t.numel() * t.element_size()
        pad = -(base + offset) % (HUGE_PAGE if nbytes >= HUGE_PAGE else ALIGN)
        if pad:
            header[f"__pad{len(order)}__"] = {
                "dtype": "U8",
                "shape": [pad],
                "data_offsets": [offset, offset + pad],
            }
            order.append((pad, None))
            offset += pad
        header[name] = {
            "dtype": CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        order.append((nbytes, t))
        offset += nbytes
    return header, order


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> None:
    """Write ``tensors`` (CPU, dense) as a safetensors file at ``path``.  Every tensor starts
    :data:`ALIGN`-aligned in the file, and one of a huge page (2 MB) or more on a huge-page
    boundary: the page cache then holds it in 2 MB folios (as written, and as read back
    through a map advised ``MADV_HUGEPAGE``), which a map of the file at a 2 MB-aligned
    address maps as huge pages.  Padding entries ``__pad<i>__`` keep the byte buffer
    hole-free, as the format requires; the header is padded with spaces to where the data
    starts (a multiple of 4096 bytes)."""
    base = 4096
    while True:
        header, order = _layout(tensors, base)
        header["__metadata__"] = dict(metadata)
        raw = json.dumps(header, separators=(",", ":")).encode()
        if 8 + len(raw) <= base:
            break
        base = -(-(8 + len(raw) + 4096) // 4096) * 4096  # pads moved: lay out again
    raw += b" " * (base - 8 - len(raw))  # the format allows trailing spaces in the header
    with open(path, "wb", buffering=0) as f:
        out = _HugePageWriter(f.fileno())
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for nbytes, t in order:
            if t is None:
                out.write(bytes(nbytes))
            elif nbytes:
                flat = t.detach().contiguous().reshape(-1)
                out.write(flat.view(torch.uint8).numpy())
        out.close()


class _HugePageWriter:
    """Writes a file in ``write`` calls that each end on a huge-page (2 MB) boundary of the
    file (but the last): small tensors are gathered into whole 2 MB pieces, a large aligned
    one goes out straight from its memory.  Where the page cache builds folios as large as the
    writes (ext4 since Linux 6.16, xfs), every 2 MB of the file is then one folio, which a map
    advised ``MADV_HUGEPAGE`` maps as a huge page -- the small weights (a 1 MB qkv, the norms)
    included; written tensor by tensor, they lay in 4 KB folios and mapped in 4 KB pages."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pos, self.buf = fd, 0, bytearray()

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            room = HUGE_PAGE - (self.pos + len(self.buf)) % HUGE_PAGE
            if not self.buf and room == HUGE_PAGE and len(view) >= HUGE_PAGE:
                whole = len(view) // HUGE_PAGE * HUGE_PAGE
                self._out(view[:whole])
                view = view[whole:]
                continue
            take = min(room, len(view))
            self.buf += view[:take]
            view = view[take:]
            if take == room:
                self._out(self.buf)
                self.buf = bytearray()

    def close(self) -> None:
        if self.buf:
            self._out(self.buf)
            self.buf = bytearray()

    def _out(self, data: Any) -> None:
        view = memoryview(data)
        while len(view):
            n = os.write(self.fd, view)
            self.pos += n
            view = view[n:]


def read_header(path: Path) -> tuple[dict[str, Any], int, bytes]:
    """(header, first data byte, the raw header bytes) of a safetensors file, checked against
    the file's size: every tensor lies inside the file and has the bytes its shape needs."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise WeightFileError(f"{path}: {size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise WeightFileError(f"{path}: header of {n} bytes in a {size}-byte file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise TypeError("not an object")
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
        raise WeightFileError(f"{path}: header does not parse ({e})") from None
    base = 8 + n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[meta["dtype"]]
            begin, end = (int(x) for x in meta["data_offsets"])
            numel = 1
            for d in meta["shape"]:
                numel *= int(d)
        except (KeyError, TypeError, ValueError):
            raise WeightFileError(f"{path}: bad header entry for {name!r}") from None
        if not 0 <= begin <= end <= size - base or end - begin != numel * dtype.itemsize:
            raise WeightFileError(
                f"{path}: tensor {name!r} spans bytes [{begin}, {end}) of a {size - base}-byte "
                f"buffer for {numel} {dtype} elements (truncated or corrupt)"
            )
    return header, base, raw


def map_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file as a view of one private, read-on-demand memory map
    of it (``UntypedStorage.from_file``: ``MAP_PRIVATE``, so a write copies that page and never
    reaches the file), and the header's metadata.  Nothing is read until a page is touched."""
    header, base, _ = read_header(path)
    size = path.stat().st_size
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))
    if size >= HUGE_PAGE:  # before any page is touched (see the module docstring)
        err = madvise(flat.data_ptr(), size, MADV_HUGEPAGE)
        if err is not None:
            logger.debug("%s: madvise(MADV_HUGEPAGE) failed (errno %s)", path, err)
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__" or (name.startswith("__pad") and name.endswith("__")):
            continue
        begin, end = meta["data_offsets"]
        view = flat[base + begin : base + end].view(DTYPES[meta["dtype"]])
        tensors[name] = view.view(meta["shape"])
    return tensors, dict(header.get("__metadata__") or {})


# ----------------------------------------------------------------------------- key factors
def checkpoint_identity(model_dir: str | Path) -> dict[str, Any]:
    """What identifies a checkpoint folder's contents without reading its tensors: the sha256
    of ``config.json`` and, per safetensors file, its size, mtime and the sha256 of its header
    (names, dtypes, shapes, offsets).  A rewritten file has a new mtime; a moved folder keeps
    its identity (paths are not part of it)."""
    model_dir = Path(model_dir)
    out: dict[str, Any] = {}
    for path in sorted(model_dir.iterdir()):
        if path.name == "config.json" or path.name.endswith(".safetensors.index.json"):
            out[path.name] = {"sha256": file_sha256(path)}
        elif path.suffix == ".safetensors" and path.is_file():
            st = path.stat()
            with open(path, "rb") as f:
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                raw = f.read(min(n, st.st_size))
            out[path.name] = {
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "header_sha256": hashlib.sha256(raw).hexdigest(),
            }
    return out


def code_files() -> list[str]:
    """Every source file whose code can change the processed tensors: the model families and
    loader, every pass and kernel (Python and C++), model preparation, the oneDNN compat
    layer, the quantization and kernel configs, and this module."""
    here = Path(__file__).resolve()
    root = here.parents[2]
    files = [here, root / "framework/engine/model_prep.py", root / "framework/compat/onednn.py"]
    files += [root / "framework/core/quantization.py", root / "framework/core/config.py"]
    for package in ("models", "passes"):
        for path in sorted((root / package).rglob("*")):
            if path.suffix in (".py", ".cpp", ".c", ".h", ".hpp") and path.is_file():
                files.append(path)
    return [str(p) for p in files]


def weight_factors(
    model_dir: str | Path,
    *,
    dtype: torch.dtype,
    quant_hash: Optional[str],
    kernel_config: str,
    passes: list[str],
    device: str,
) -> dict[str, Any]:
    """The factors hashed into a processed-weights key (see the module docstring)."""
    cpu = torch.cpu
    isa = {}
    for flag in ("avx2", "avx512", "avx512_bf16", "vnni", "amx_tile", "amx_fp16"):
        probe = getattr(cpu, f"_is_{flag}_supported", None)
        if probe is not None:
            isa[flag] = bool(probe())
    return {
        "kind": "processed_weights",
        "format": FORMAT,
        "checkpoint": checkpoint_identity(model_dir),
        "dtype": str(dtype),
        "device": device,
        "quantization": quant_hash,
        "kernel_config": kernel_config,
        "passes": sorted(passes),
        "tensor_parallel": tp_factors(),
        "code": source_factors(code_files()),
        "env": {
            "torch": torch.__version__,
            "torch_git": getattr(torch.version, "git_version", None),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_isa_flags": isa,
            "small_m_portable": os.environ.get("PIECEWISE_SMALL_M_LINEAR_PORTABLE", ""),
        },
    }


# ----------------------------------------------------------------------------- the cache
class WeightCache:
    """One key's processed weights: :meth:`load` maps them, :meth:`save` writes them."""

    def __init__(self, root: str | Path, factors: Mapping[str, Any], model_tag: str) -> None:
        # A folder of its own under the cache root: the same layout as the compiled pieces'
        # (``python -m framework.cache ls|verify|prune <root>/weights``), kept apart from them.
        root = Path(root).expanduser() / SUBDIR
        self.root, self.factors, self.model_tag = root, factors, model_tag
        self.key = compute_cache_key(factors)[0]
        self.rank = int(factors["tensor_parallel"]["rank"])
        self.dir = self.root / self.key / f"rank_{self.rank}" / model_tag
        self.path = self.dir / "artifacts" / f"{ENTRY}.bin"
        self._store: Optional[ArtifactStore] = None
        self.result = "miss"
        """``hit``, ``miss``, ``corrupt`` (found, failed verification, recomputed) or
        ``written`` after :meth:`save`."""
        self.page_cache_frac: Optional[float] = None
        """On a hit: the fraction of the file the page cache held when it was mapped
        (:func:`framework.core.page_cache.file_resident_fraction`; None where unknown)."""

    @property
    def store(self) -> ArtifactStore:
        """The key's store, opened (its directories created) on first use: a start that
        finds nothing and saves nothing leaves nothing behind."""
        if self._store is None:
            self._store = ArtifactStore(
                self.root, self.key, self.factors, self.rank, self.model_tag
            )
        return self._store

    def load(self) -> Optional[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
        """The mapped tensors and the metadata saved with them, or None (nothing stored, or
        a file that fails verification: one warning naming it, the entry is dropped)."""
        if not (self.dir / INDEX_FILE).is_file():
            return None
        record = self.store.entries().get(ENTRY)
        if record is None:
            return None
        # Before anything reads the file (its header check reads ahead): what the warm-up
        # forward will find in memory rather than on disk.  Where some of it is on disk, a
        # thread reads it in front to back meanwhile (at the disk's sequential rate: the
        # forward's faults alone, two threads in layer order, read at about half of it).
        self.page_cache_frac = file_resident_fraction(self.path)
        if self.page_cache_frac is not None and self.page_cache_frac < 1.0:
            read_ahead(self.path)
        try:
            problem = self._problem(record)
        except (OSError, WeightFileError) as e:
            problem = str(e)
        if problem is None:
            try:
                tensors, metadata = map_safetensors(self.path)
                meta = json.loads(metadata["piecewise"])
            except (OSError, WeightFileError, KeyError, ValueError, RuntimeError) as e:
                problem = f"cannot map it ({type(e).__name__}: {e})"
            else:
                self.result = "hit"
                self.store.stats.hits += 1
                return tensors, meta
        self.corrupt(problem)
        return None

    def corrupt(self, problem: str) -> None:
        """Drop the entry (warning naming the file); the caller recomputes."""
        self.result = "corrupt"
        self.store.discard(ENTRY, problem)  # warns (CacheCorruptionWarning) naming the file
        if self.path.exists():  # a record naming another file: this one is not vouched for
            warnings.warn(
                f"piecewise cache: {self.path}: {problem}; dropping it (will recompute)",
                CacheCorruptionWarning,
                stacklevel=3,
            )
            remove(self.path)

    def _problem(self, record: Mapping[str, Any]) -> Optional[str]:
        if not isinstance(record, Mapping) or record.get("artifact") != f"artifacts/{ENTRY}.bin":
            return f"bad index record {record!r}"
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return "file is missing"
        if st.st_size != record.get("size"):
            return f"size {st.st_size} bytes, index records {record.get('size')} (truncated?)"
        _, _, raw = read_header(self.path)
        blob = self.store.load_blob(META_BLOB)
        stamp = json.loads(blob) if blob is not None else {}
        same = stamp.get("identity") == [st.st_ino, st.st_size, st.st_mtime_ns]
        if same and stamp.get("header_sha256") == hashlib.sha256(raw).hexdigest():
            return None  # the file written, untouched since (the full hash is `verify`'s)
        logger.info("%s changed since it was written: hashing it in full", self.path)
        if file_sha256(self.path) != record.get("sha256"):
            return "sha256 mismatch (corrupted)"
        with self.store.lock():  # a read-only cache: the lock turns the store read-only
            if self.store.writable:  # intact (e.g. a copied cache): the next start is fast
                self._stamp(raw)
        return None

    def _writable(self) -> bool:
        """Whether the cache can take a file, probed before opening the store: a disk that
        refuses (full, read-only) is one log line here, not a second warning beside the
        compiled pieces' store's own."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = tmp_path(self.dir, "probe")
            with open(probe, "wb") as f:
                f.write(b"0")
            # Another start holding the store's writer lock sweeps every temp file here
            # (sweep_stale_temps, lock held) and this probe is written before that lock: it may
            # be gone already, which says nothing against the disk.
            remove(probe)
        except OSError as e:
            if not is_environment_error(e):
                raise
            logger.warning("processed weights not cached: cannot write to %s (%s)", self.dir, e)
            return False
        return True

    def _stamp(self, raw: bytes) -> None:
        """Record what the verified file is now.  A recent mtime is first set back by
        :data:`BACKDATE_NS`: file times are coarse (a few ms), so a write right after this
        one could keep the mtime; any later write now moves it."""
        st = self.path.stat()
        now = time.time_ns()
        if now - st.st_mtime_ns < BACKDATE_NS:
            try:
                os.utime(self.path, ns=(st.st_atime_ns, now - BACKDATE_NS))
            except OSError:
                pass  # a read-only cache: the identity stays as it is
            st = self.path.stat()
        stamp = {
            "identity": [st.st_ino, st.st_size, st.st_mtime_ns],
            "header_sha256": hashlib.sha256(raw).hexdigest(),
        }
        self.store.store_blob(META_BLOB, json.dumps(stamp).encode())

    def save(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Optional[Path]:
        """Write the tensors and ``meta`` (plain JSON data) atomically; None when the disk
        refused (one :class:`CacheWriteWarning`, from the store)."""

        if not self._writable():
            return None

        def write(tmp: Path) -> None:
            write_safetensors(tmp, tensors, {"piecewise": json.dumps(meta)})

        path = self.store.store(ENTRY, ENTRY, write)  # atomic; records size and sha256
        if path is None:
            return None
        self._stamp(read_header(path)[2])
        self.result = "written"
        return path
