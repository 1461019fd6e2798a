"""The context pack: one safetensors file with a JSON manifest in its header.

Layout (``docs/pack-format.md`` has the full description)::

    [8-byte header length][header JSON][tensor data]
    header JSON = {"__metadata__": {"sekv": "<manifest JSON>", "sekv_header_sha256": "<hex>"}, "<tensor>": {...}, ...}

Integrity: ``sekv_header_sha256`` is the sha256 of the whole header (length prefix included) with that value
zeroed, so the manifest and the tensor table are covered; the manifest's ``tensors`` gives every tensor's
sha256 (over 16 MiB chunks, see :func:`tensor_digest`), checked when the tensor is first read.  Opening a
pack reads and checks only the header: a multi-GB pack opens in milliseconds and a method pays for the
tensors it reads.  The file is opened once; every tensor is read from that descriptor into memory and
hashed there (what is checked is what is used, even if the path is replaced meanwhile).

Everything read from a pack is untrusted: the header, the manifest (:func:`check_manifest`) and the tensor
values (:func:`check_tensors`, driven by each cache method's ``tensor_specs`` / ``validate``) are type- and
range-checked before use, and every problem is one :class:`PackError`.  Tensors are only ever read as raw
little-endian numbers (no pickle).  Writes are atomic: a temporary file in the target directory, fsync,
``os.replace``; an interrupted write leaves no partial pack.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import re
import secrets
import shutil
import stat
import struct
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from .errors import PackError, SekvError

MAGIC = "SEKV-PACK"
#: 4: manifest and tensor table under a header checksum, per-tensor sha256, method parameters written from
#: their typed dataclasses (sekv_core/methods/params.py); older packs are refused with one line (re-ingest)
FORMAT_VERSION = 4
READABLE_VERSIONS = (4,)
SUFFIX = ".sekv"
_META_KEY = "sekv"
_HEADER_SUM_KEY = "sekv_header_sha256"
_ZERO = "0" * 64
_MAX_HEADER = 256 << 20  # token ids of a 1M-token document are ~8 MB of JSON
_CHUNK = 16 << 20
_CACHE_MAX = 4 << 20  # tensors up to this size are kept after their first (checked) read
_HEX64 = re.compile(r"[0-9a-f]{64}")

#: safetensors dtype codes <-> torch dtypes (the ones a pack may hold)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_CODE = {v: k for k, v in DTYPES.items()}
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="sekv-pack")
    return _POOL


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _strict_json(raw: str | bytes) -> Any:
    """json.loads that refuses NaN / Infinity and duplicate keys (two parsers must never disagree on a pack)."""

    def no_dupes(pairs):
        d = {}
        for k, v in pairs:
            if k in d:
                raise ValueError(f"duplicate key {k!r}")
            d[k] = v
        return d

    def no_constants(c):
        raise ValueError(f"{c} is not allowed")

    return json.loads(raw, object_pairs_hook=no_dupes, parse_constant=no_constants)


def _raw_bytes(t: torch.Tensor):
    """A contiguous CPU tensor's bytes as a buffer (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else memoryview(b"")


def _chunks(buf) -> list:
    mv = memoryview(buf).cast("B")
    return [mv[i : i + _CHUNK] for i in range(0, len(mv), _CHUNK)] or [mv]


def _chunk_sha(part) -> bytes:
    return hashlib.sha256(part).digest()


def tensor_digest(buf) -> str:
    """sha256 of the sha256s of the buffer's 16 MiB chunks (hashed on several threads: hashlib lets go of the GIL)."""
    parts = _chunks(buf)
    digests = [_chunk_sha(parts[0])] if len(parts) == 1 else list(_pool().map(_chunk_sha, parts))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def _finish_digest(futures: list) -> str:
    """:func:`tensor_digest` from the futures of its chunks' sha256s (hashed on the pool)."""
    return hashlib.sha256(b"".join(f.result() for f in futures)).hexdigest()


# -- writing --------------------------------------------------------------------------------------------------


#: temporary files of output slots neither renamed onto their pack nor discarded yet (discard_unfinished)
_UNFINISHED: set[Path] = set()


def _new_temp(parent: Path, name: str) -> tuple[int, Path]:
    """A new temporary file ``.NAME.RANDOM.tmp`` in ``parent``, opened read-write (mode 0600, as mkstemp makes it):
    (fd, path).  Its path is registered (discard_unfinished) before the file exists, so an interrupt landing
    anywhere in here or after it leaves nothing the entry point does not remove.  OSError as os.open raises it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = parent / f".{name}.{secrets.token_hex(8)}.tmp"
        _UNFINISHED.add(tmp)
        try:
            return os.open(tmp, flags, 0o600), tmp
        except FileExistsError:  # another process's name: not ours to remove
            _UNFINISHED.discard(tmp)
        except OSError:
            _UNFINISHED.discard(tmp)
            raise
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(parent))


def discard_unfinished() -> None:
    """Remove every output slot's temporary file not yet renamed onto its pack: the CLI's last step when a command
    ends by an error, Ctrl-C or SIGTERM, wherever the interrupt landed (even between a slot's making and the
    ``try`` that would discard it)."""
    for tmp in list(_UNFINISHED):
        tmp.unlink(missing_ok=True)
        _UNFINISHED.discard(tmp)


@dataclass
class OutputSlot:
    """A pack's destination, checked and reserved before the (long) work that produces it: the temporary file
    exists in the target directory (so the directory is writable), and is renamed onto ``path`` by write_pack."""

    path: Path
    tmp: Path

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)
        _UNFINISHED.discard(self.tmp)

    def done(self) -> None:
        """The temporary file became the pack (renamed)."""
        _UNFINISHED.discard(self.tmp)


def is_pack_file(path: Path) -> bool:
    """Whether ``path`` starts like a sekv pack (a safetensors header with a sekv manifest), any version."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return False
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                return False
            meta = json.loads(f.read(n)).get("__metadata__") or {}
            return isinstance(meta, dict) and isinstance(meta.get(_META_KEY), str) and f'"{MAGIC}"' in meta[_META_KEY]
    except (OSError, ValueError, AttributeError):
        return False


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def prepare_output(path: str | Path, *, force: bool = False, inputs: Sequence[str | Path] = (), needed_bytes: int = 0) -> OutputSlot:
    """Check the output path before any work: not an input, not a directory, not a file that is not a sekv pack
    (unless ``force``), its directory writable and (roughly) ``needed_bytes`` free.  Raises SekvError."""
    path = Path(path)
    shown = str(path)
    for i in inputs:
        if i is not None and str(i) != "-" and (_same_file(path, Path(i)) or path.resolve() == Path(i).resolve()):
            raise SekvError(f"{shown}: the output would overwrite the input document; choose another -o path")
    if path.is_dir():
        raise SekvError(f"{shown}: is a directory; give a file path for the pack (-o DIR/NAME{SUFFIX})")
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise SekvError(f"{shown}: exists and is not a regular file; choose another -o path")
        if not force and not is_pack_file(path):
            raise SekvError(f"{shown}: exists and is not a sekv pack; refusing to replace it (choose another -o path, or --force)")
    parent = path.parent
    if not parent.is_dir():
        raise SekvError(f"{shown}: the directory {parent} does not exist; create it first")
    if needed_bytes:
        try:
            free = shutil.disk_usage(parent).free
        except OSError:
            free = None
        if free is not None and free < needed_bytes:
            raise SekvError(
                f"{shown}: {parent} has {free / 2**20:.0f} MiB free, the pack needs up to about {needed_bytes / 2**20:.0f} MiB; free space or choose another -o path"
            )
    try:
        fd, tmp = _new_temp(parent, path.name)
    except OSError as e:
        raise SekvError(f"{shown}: cannot write in {parent} ({e.strerror or type(e).__name__}); choose another -o path") from None
    os.close(fd)
    return OutputSlot(path, tmp)


def write_pack(path: Path, manifest: dict[str, Any], tensors: dict[str, torch.Tensor], slot: OutputSlot | None = None) -> int:
    """Write atomically (into ``slot``'s temporary file when given); return the file size.  OSError -> SekvError.

    A :class:`PackWriter` given every tensor at once, in name order, with a header room of exactly the header's
    length (the digests' hex is 64 characters whatever they are): the data region is written while the pool hashes
    it, then the header at offset 0, fsync, rename."""
    path = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in sorted(tensors.items())}
    for k, v in tensors.items():
        if v.dtype not in _CODE:
            raise ValueError(f"pack tensor {k}: dtype {v.dtype} is not storable")
    full = dict(manifest, magic=MAGIC, format_version=FORMAT_VERSION)
    full.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    room = len(_header(full, tensors, dict.fromkeys(tensors, _ZERO)))
    if slot is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        slot = prepare_output(path, force=True)
    try:
        writer = PackWriter(slot, room)
    except OSError as e:
        slot.discard()
        raise SekvError(f"{path}: cannot write the pack ({e.strerror or type(e).__name__}); nothing was written") from None
    try:
        for k, v in tensors.items():
            writer.put(k, v)
    except BaseException:
        writer.abort()
        raise
    return writer.finish(full)


def header_room(manifest: dict[str, Any], max_tensors: int) -> int:
    """Header bytes to reserve for a pack written while its tensors are made (:class:`PackWriter`): the manifest
    known so far (its JSON escaped once more inside the header's), ``max_tensors`` tensor entries (each listed twice:
    the manifest's sha256 and the table's offsets) and room for the rest; a header that outgrows it still works
    (the data region moves), only slower."""
    return (2 * len(json.dumps(manifest, allow_nan=False)) + 512 * max(int(max_tensors), 1) + (64 << 10) + 7) // 8 * 8


#: bytes a streamed pack's writer may hold queued (host buffers waiting for their write) before submit() waits
WRITER_QUEUE_BYTES = 1 << 30
#: a streamed pack's writeback is started every this many bytes written (sync_file_range; else fdatasync), so that
#: the fsync before the rename has little left to wait for
WRITEBACK_EVERY = 256 << 20


def _writeback_starter():
    """fd, offset, nbytes -> start the kernel's writeback of that range without waiting for it (Linux's
    sync_file_range(SYNC_FILE_RANGE_WRITE)); None where there is none (the writer then fdatasyncs instead)."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    except (OSError, AttributeError):
        return None

    def start(fd: int, off: int, n: int) -> None:
        if fn(fd, off, n, 2) != 0:  # SYNC_FILE_RANGE_WRITE
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    return start


class PackWriter:
    """A pack written while its tensors are still being made (sekv_core/ingest.py's pipelined ingest): the same file
    :func:`write_pack` writes (docs/pack-format.md), the header's room reserved first and its bytes written last.

    ``reserve(name, dtype, shape)`` places a tensor in the data region now, to be filled piece by piece
    (``submit(fn)``: ``fn`` runs on the writer thread and returns ``[(name, byte offset in the tensor, buffer)]``;
    pieces never overlap); ``put(name, tensor)`` appends a whole one.  Every 16 MiB hash chunk (:func:`tensor_digest`)
    is hashed on the pack's pool as soon as its bytes are all written (read back from the page cache when they came
    in pieces).  The writer thread starts the kernel's writeback of what it wrote as it goes.  ``finish(manifest)``
    writes the header (padded with spaces to the reserved room; a larger one moves the data region), fsyncs and
    renames onto the target; ``abort()`` (or any error) removes the temporary file.  Writes on one thread, in order:
    ``timeline`` records each write's (start, end, bytes) for the benchmarks."""

    def __init__(self, slot: OutputSlot, header_bytes: int):
        import queue
        import threading

        self.slot, self.path = slot, slot.path
        self.head = (max(int(header_bytes), 16) + 7) // 8 * 8
        self.fd = os.open(slot.tmp, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.offsets: dict[str, int] = {}
        self.end = 0  # data-region bytes placed
        self._done: dict[str, list[int]] = {}  # per tensor, bytes written into each hash chunk
        self._hashes: dict[str, list] = {}  # per tensor, each hash chunk's future (None until it is complete)
        self._q: Any = queue.Queue()
        self._queued = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False  # finished or aborted
        self._since_writeback = 0
        self._writeback = _writeback_starter()
        self.timeline: list[tuple[float, float, int]] = []
        self.written = 0
        self._lock = threading.Lock()  # reserve() runs on the caller's thread and (submit_tensors) on the writer's
        self._thread = threading.Thread(target=self._run, name="sekv-pack-writer", daemon=True)
        self._thread.start()

    # -- placing ------------------------------------------------------------------------------------------------

    def reserve(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> int:
        """Place tensor ``name`` at the end of the data region; its byte offset there."""
        if dtype not in _CODE:
            raise ValueError(f"pack tensor {name}: dtype {dtype} is not storable")
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        with self._lock:
            if name in self.specs:
                raise ValueError(f"pack tensor {name} placed twice")
            self.specs[name], self.offsets[name] = (dtype, tuple(int(x) for x in shape)), self.end
            self._done[name] = [0] * max(1, -(-n // _CHUNK))
            self._hashes[name] = [None] * len(self._done[name])
            if n == 0:
                self._hashes[name][0] = _pool().submit(_chunk_sha, b"")
            self.end += n
            return self.offsets[name]

    def nbytes(self, name: str) -> int:
        dt, shape = self.specs[name]
        return math.prod(shape) * torch.empty(0, dtype=dt).element_size()

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Append a whole tensor (host memory; kept alive until written)."""
        t = tensor.detach().contiguous().cpu()
        self.reserve(name, t.dtype, t.shape)
        self.submit(lambda: [(name, 0, _raw_bytes(t))], t.numel() * t.element_size())

    def submit_tensors(self, fn) -> None:
        """Append the tensors ``fn()`` returns ({name: host tensor}), ``fn`` run on the writer thread, in order (it
        may wait there for them: compress's layers as they reach the host)."""

        def pieces():
            out = []
            for name, t in sorted(fn().items()):
                t = t.detach().contiguous().cpu()
                self.reserve(name, t.dtype, t.shape)
                out.append((name, 0, _raw_bytes(t)))
            return out

        self.submit(pieces)

    def submit(self, fn, nbytes: int = 0, reused: bool = False) -> None:
        """Run ``fn`` on the writer thread, in order, and write the pieces it returns.  ``nbytes``: about how many it
        will write (waits while more than WRITER_QUEUE_BYTES are queued); ``reused``: the pieces' buffers are
        written into again after ``fn``'s next call (a staging buffer), so they are hashed from the file."""
        self._check()
        with self._cv:
            while self._queued > 0 and self._queued + nbytes > WRITER_QUEUE_BYTES and self._error is None:
                self._cv.wait()
            self._queued += nbytes
        self._q.put((fn, nbytes, reused))

    def _check(self) -> None:
        if self._error is not None:
            e = self._error
            if isinstance(e, OSError):
                raise SekvError(f"{self.path}: cannot write the pack ({e.strerror or type(e).__name__}); nothing was written") from None
            raise e

    # -- the writer thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, nbytes, reused = item
            try:
                if self._error is None:
                    for name, off, buf in fn():
                        self._write(name, off, buf, reused)
            except BaseException as e:  # noqa: BLE001 - handed to the thread that finishes or aborts
                self._error = self._error or e
            finally:
                with self._cv:
                    self._queued -= nbytes
                    self._cv.notify_all()

    def _write(self, name: str, off: int, buf, reused: bool = False) -> None:
        mv = memoryview(buf).cast("B")
        n = len(mv)
        if off < 0 or off + n > self.nbytes(name):
            raise ValueError(f"pack tensor {name}: a piece [{off}, {off + n}) outside its {self.nbytes(name)} bytes")
        t0 = time.perf_counter()
        _pwrite_all(self.fd, mv, self.head + self.offsets[name] + off)
        self.written += n
        self._since_writeback += n
        if self._since_writeback >= WRITEBACK_EVERY:
            if self._writeback is not None:
                self._writeback(self.fd, 0, 0)  # 0, 0: the whole file's dirty pages
            else:
                os.fdatasync(self.fd)
            self._since_writeback = 0
        self.timeline.append((t0, time.perf_counter(), n))
        self._hashed(name, off, mv, reused)

    def _hashed(self, name: str, off: int, mv: memoryview, reused: bool) -> None:
        """Count the piece's bytes into its hash chunks; hash each chunk it completes (from ``mv`` when the piece
        covers the chunk, else read back from the file)."""
        total, done, futs, pool = self.nbytes(name), self._done[name], self._hashes[name], _pool()
        a, b = off, off + len(mv)
        for c in range(a // _CHUNK, (b - 1) // _CHUNK + 1 if b > a else a // _CHUNK):
            c0, c1 = c * _CHUNK, min(total, (c + 1) * _CHUNK)
            done[c] += min(b, c1) - max(a, c0)
            if done[c] == c1 - c0:
                if a <= c0 and c1 <= b and not reused:
                    futs[c] = pool.submit(_chunk_sha, mv[c0 - a : c1 - a])
                else:
                    futs[c] = pool.submit(self._sha_of_file, self.head + self.offsets[name] + c0, c1 - c0)

    def _sha_of_file(self, at: int, n: int) -> bytes:
        with open(self.slot.tmp, "rb") as f:
            return _chunk_sha(_read_exact(f, at, n))

    # -- the end --------------------------------------------------------------------------------------------------

    def _drain(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()

    @property
    def open(self) -> bool:
        """Whether tensors may still be given (neither finished nor aborted)."""
        return not self._closed

    def finish(self, manifest: dict[str, Any]) -> int:
        """Wait for the writes, write the header, fsync, rename onto the target: the file size.  Every placed tensor
        must have been written whole.  On any error nothing is left (the temporary file removed)."""
        if self._closed:
            raise AssertionError("the pack writer was finished or aborted already")
        try:
            self._drain()
            self._check()
            digests = {}
            for name, futs in self._hashes.items():
                if any(f is None for f in futs):
                    raise AssertionError(f"pack tensor {name} was not written whole")
                digests[name] = _finish_digest(futs)
            manifest = dict(manifest, magic=MAGIC, format_version=FORMAT_VERSION)
            manifest.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            if isinstance(manifest.get("sizes"), dict):  # every tensor is placed now: their bytes
                manifest["sizes"] = dict(manifest["sizes"], tensor_bytes=self.end)
            names = sorted(self.specs)
            specs = {k: self.specs[k] for k in names}
            head = _header(manifest, specs, digests, self.offsets, self.head)
            if len(head) != self.head:  # more than the reserved room: the data region moves behind the header
                self._relocate(head)
            else:
                _pwrite_all(self.fd, head, 0)
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.slot.tmp, self.path)
            self.slot.done()
            self._closed = True
        except OSError as e:
            self.abort()
            raise SekvError(f"{self.path}: cannot write the pack ({e.strerror or type(e).__name__}); nothing was written") from None
        except BaseException:
            self.abort()
            raise
        return self.path.stat().st_size

    def _relocate(self, head: bytes) -> None:
        """The header outgrew its room: a new temporary file with the header, then the data region copied in."""
        fd, tmp = _new_temp(self.path.parent, self.path.name)
        try:
            _pwrite_all(fd, head, 0)
            left, src, dst = self.end, self.head, len(head)
            while left > 0:
                n = os.copy_file_range(self.fd, fd, left, src, dst) if hasattr(os, "copy_file_range") else 0
                if n <= 0:
                    data = os.pread(self.fd, min(left, _CHUNK), src)
                    n = _pwrite_all(fd, data, dst)
                left, src, dst = left - n, src + n, dst + n
        except BaseException:
            os.close(fd)
            OutputSlot(self.path, tmp).discard()
            raise
        os.close(self.fd)
        self.slot.discard()
        self.fd, self.slot = fd, OutputSlot(self.path, tmp)

    def abort(self) -> None:
        """Stop, and remove the temporary file (an error or an interrupt anywhere in the ingest)."""
        if self._closed:
            return
        self._closed = True
        self._error = self._error or KeyboardInterrupt()
        try:
            self._drain()
        finally:
            for futs in self._hashes.values():
                for f in futs:
                    if f is not None:
                        f.cancel()
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self.slot.discard()


def _pwrite_all(fd: int, data, at: int) -> int:
    mv = memoryview(data).cast("B")
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done:], at + done)
    return done


def _header(manifest: dict[str, Any], tensors: dict[str, torch.Tensor], digests: dict[str, str],
            offsets: dict[str, int] | None = None, size: int = 0) -> bytes:
    """The pack's header (length prefix, JSON, padding) with these tensor digests, its own checksum filled in.
    ``tensors``: name -> a tensor, or a (dtype, shape) pair; ``offsets``: each one's byte offset in the data region
    (None: one after the other in this order); ``size``: pad the header with spaces to this many bytes (the length
    prefix included) where it is shorter (a header whose room was reserved before the data was written)."""
    manifest = dict(manifest)
    specs = {k: (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else (v[0], tuple(v[1])) for k, v in tensors.items()}
    manifest["tensors"] = {k: {"dtype": dtype_name(dt), "shape": list(shape), "sha256": digests[k]} for k, (dt, shape) in specs.items()}
    header: dict[str, Any] = {"__metadata__": {_META_KEY: json.dumps(manifest, allow_nan=False), _HEADER_SUM_KEY: _ZERO}}
    off = 0
    for k, (dt, shape) in specs.items():
        n = math.prod(shape) * torch.empty(0, dtype=dt).element_size()
        if offsets is not None:
            off = offsets[k]
        header[k] = {"dtype": _CODE[dt], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    body = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    body += b" " * max(-(8 + len(body)) % 8, size - 8 - len(body))  # safetensors aligns the data region to 8 bytes
    head = struct.pack("<Q", len(body)) + body
    digest = hashlib.sha256(head).hexdigest()
    return head.replace(f'"{_HEADER_SUM_KEY}":"{_ZERO}"'.encode(), f'"{_HEADER_SUM_KEY}":"{digest}"'.encode(), 1)


# -- reading --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset
    end: int
    sha256: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Pack:
    path: Path
    manifest: dict[str, Any]
    entries: dict[str, TensorEntry] = field(default_factory=dict)
    _file: Any = None
    _cache: dict[str, torch.Tensor] = field(default_factory=dict)
    file_bytes: int = 0
    _map: Any = None  # the file's memory map, made by the first mapped()

    @property
    def method(self) -> str:
        return self.manifest["method"]

    @property
    def params(self) -> dict[str, Any]:
        return self.manifest.get("method_params", {})

    @property
    def token_ids(self) -> list[int]:
        return self.manifest["token_ids"]

    def keys(self) -> list[str]:
        return list(self.entries)

    def info(self, name: str) -> TensorEntry:
        """dtype / shape of a tensor from the (checked) header, without reading it."""
        try:
            return self.entries[name]
        except KeyError:
            raise PackError(f"{self.path}: tensor '{name}' is missing; the pack is damaged, re-ingest the document") from None

    def get(self, name: str) -> torch.Tensor:
        """The tensor, read from the pack's open file and checked against its sha256 (CPU, its own memory)."""
        if name in self._cache:
            return self._cache[name]
        e = self.info(name)
        n = e.end - e.start
        buf = torch.empty(n, dtype=torch.uint8)
        if n:
            mv = memoryview(buf.numpy())
            fd = self._file.fileno()

            def read(a: int) -> None:
                want = min(_CHUNK, n - a)
                got = os.preadv(fd, [mv[a : a + want]], e.start + a)
                if got != want:
                    raise PackError(f"{self.path}: the file is shorter than its header says; the pack is truncated, re-ingest the document")

            try:
                list(_pool().map(read, range(0, n, _CHUNK)) if n > _CHUNK else map(read, [0]))
            except OSError as err:
                raise PackError(f"{self.path}: cannot read tensor '{name}' ({err.strerror})") from None
        if tensor_digest(buf.numpy() if n else b"") != e.sha256:
            raise PackError(f"{self.path}: checksum mismatch in tensor '{name}': the pack is damaged; re-ingest the document")
        t = buf.view(e.dtype).reshape(e.shape) if n else torch.empty(e.shape, dtype=e.dtype)
        if n <= _CACHE_MAX:
            self._cache[name] = t
        return t

    def mapped(self, name: str) -> torch.Tensor:
        """The tensor over the pack file's memory map, NOT checked against its sha256 (:meth:`check` does that): what
        the ask reads a few rows of (the zoom tier, sekv/zoom_tier.py), so that nothing reads the whole tensor first.
        Read-only: the map is the file's pages."""
        e = self.info(name)
        if e.end == e.start:
            return torch.empty(e.shape, dtype=e.dtype)
        self._mapping()
        if e.end > len(self._map):
            raise PackError(f"{self.path}: the file is shorter than its header says; the pack is truncated, re-ingest the document")
        with warnings.catch_warnings():  # a read-only buffer: torch warns that writes would fail; nothing writes it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=e.end - e.start, offset=e.start)
        return raw.view(e.dtype).reshape(e.shape)

    def _mapping(self):
        if self._map is None:
            if self._file is None:
                raise PackError(f"{self.path}: the pack is closed")
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        return self._map

    def check(self, name: str) -> None:
        """Check a tensor's bytes against its sha256 without keeping them (:meth:`mapped`'s tensors), read through
        the file's map (so its pages are mapped for the reads that follow); hashed on the calling thread alone, a
        chunk at a time (a background check leaves the pool to the reads).  Raises PackError."""
        e = self.info(name)
        if e.end == e.start:
            ok = tensor_digest(b"") == e.sha256
        else:
            m = self._mapping()
            if e.end > len(m):
                raise PackError(f"{self.path}: the file is shorter than its header says; the pack is truncated, re-ingest the document")
            h = hashlib.sha256()
            with memoryview(m) as mv:
                for a in range(e.start, e.end, _CHUNK):
                    h.update(_chunk_sha(mv[a : min(a + _CHUNK, e.end)]))
            ok = h.hexdigest() == e.sha256
        if not ok:
            raise PackError(f"{self.path}: checksum mismatch in tensor '{name}': the pack is damaged; re-ingest the document")

    def size_bytes(self) -> int:
        return self.file_bytes

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # tensors still view it: the map goes with the last of them
                pass
            self._map = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def n_tokens(self) -> int:
        return int(self.manifest["n_tokens"])


def _damaged(what: str) -> PackError:
    return PackError(f"{what}; the pack is damaged or was not written by sekv, re-ingest the document")


def read_pack(path: str | Path) -> Pack:
    """Open a pack: one open file, the header read once and checked (size, checksum, tensor table, magic, version)."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise PackError(f"{path}: no such pack; create one with `sekv ingest DOCUMENT`") from None
    except OSError as e:
        raise PackError(f"{path}: cannot read pack: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise PackError(f"{path}: is a directory, not a pack")
    if not stat.S_ISREG(st.st_mode):
        raise PackError(f"{path}: is not a regular file (a FIFO or device?); a pack is a file made by `sekv ingest`")
    try:
        f = open(path, "rb", buffering=0)
    except OSError as e:
        raise PackError(f"{path}: cannot read pack: {e.strerror}") from None
    try:
        manifest, entries, size = _read_header(f)
    except PackError as e:
        f.close()
        raise PackError(f"{path}: {e}") from None
    except OSError as e:
        f.close()
        raise PackError(f"{path}: cannot read pack: {e.strerror}") from None
    return Pack(path, manifest, entries, f, file_bytes=size)


def _read_exact(f, offset: int, n: int) -> bytes:
    data = os.pread(f.fileno(), n, offset) if n else b""
    if len(data) != n:
        raise PackError("the file is truncated")
    return data


def _read_header(f) -> tuple[dict, dict[str, TensorEntry], int]:
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise PackError("file is too short to be a sekv pack")
    (n,) = struct.unpack("<Q", _read_exact(f, 0, 8))
    if n < 2 or n > _MAX_HEADER or 8 + n > size:
        raise PackError("not a sekv pack (no safetensors header)")
    head = _read_exact(f, 0, 8 + n)
    try:
        header = _strict_json(head[8:])
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise PackError("not a sekv pack (unreadable header)") from None
    if not isinstance(header, dict):
        raise PackError("not a sekv pack (unreadable header)")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not isinstance(meta.get(_META_KEY), str):
        raise PackError("not a sekv pack (no sekv manifest)")
    claimed = meta.get(_HEADER_SUM_KEY)
    if not isinstance(claimed, str) or not _HEX64.fullmatch(claimed):
        raise _version_error(meta[_META_KEY]) or _damaged("the header checksum is missing")
    field_bytes = f'"{_HEADER_SUM_KEY}":"{claimed}"'.encode()
    if head.count(field_bytes) != 1 or hashlib.sha256(head.replace(field_bytes, f'"{_HEADER_SUM_KEY}":"{_ZERO}"'.encode())).hexdigest() != claimed:
        raise _damaged("checksum mismatch in the header (manifest or tensor table)")
    try:
        manifest = _strict_json(meta[_META_KEY])
    except (ValueError, RecursionError):
        raise _damaged("unreadable manifest") from None
    if not isinstance(manifest, dict) or manifest.get("magic") != MAGIC:
        raise PackError("not a sekv pack (bad magic)")
    version = manifest.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise _version_error(meta[_META_KEY]) or _damaged(f"format_version {version!r} is not a pack format version")
    for key, kind in (("method", str), ("method_params", dict), ("tensors", dict)):
        if not isinstance(manifest.get(key), kind):
            raise _damaged(f"the manifest's '{key}' is missing or not a {kind.__name__}")
    listed = manifest["tensors"]
    entries: dict[str, TensorEntry] = {}
    for name, (dtype, shape, start, end) in _table(header, 8 + n, size).items():
        want = listed.get(name)
        if (not isinstance(want, dict) or want.get("dtype") != dtype_name(dtype) or want.get("shape") != list(shape)
                or not isinstance(want.get("sha256"), str) or not _HEX64.fullmatch(want["sha256"])):
            raise _damaged(f"tensor {name!r} does not match the manifest's tensor list")
        entries[name] = TensorEntry(dtype, shape, start, end, want["sha256"])
    if set(listed) != set(entries):
        raise _damaged("the manifest lists tensors the file does not hold")
    return manifest, entries, size


def _table(header: dict, data0: int, size: int) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """A safetensors tensor table (the header without ``__metadata__``), checked: known dtypes, sane shapes, byte
    ranges inside the file, matching the shapes, disjoint, and covering the data region exactly.
    name -> (dtype, shape, absolute start, end)."""
    out = {}
    spans = []
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise _damaged(f"bad tensor table entry {name!r}")
        dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dt, str) or dt not in DTYPES:
            raise _damaged(f"tensor {name!r} has unsupported dtype {dt!r}")
        if not isinstance(shape, list) or len(shape) > 8 or not all(type(x) is int and 0 <= x < 2**40 for x in shape):
            raise _damaged(f"tensor {name!r} has a bad shape")
        if not isinstance(offs, list) or len(offs) != 2 or not all(type(x) is int for x in offs) or not 0 <= offs[0] <= offs[1] <= size - data0:
            raise _damaged(f"tensor {name!r} lies outside the file")
        dtype = DTYPES[dt]
        if offs[1] - offs[0] != math.prod(shape) * torch.empty(0, dtype=dtype).element_size():
            raise _damaged(f"tensor {name!r}: its byte range does not match its shape")
        out[name] = (dtype, tuple(shape), data0 + offs[0], data0 + offs[1])
        spans.append((offs[0], offs[1]))
    spans.sort()
    if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
        raise _damaged("tensors overlap in the file")
    if (spans[-1][1] if spans else 0) != size - data0:
        raise _damaged("the file's length does not match its tensor table (truncated or appended to)")
    return out


def safetensors_digest(path: Path) -> str:
    """sha256 over a safetensors file's tensors in name order (name, dtype, shape, and the bytes'
    :func:`tensor_digest`): the same for the same tensors, whatever the header's key order or metadata."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        (n,) = struct.unpack("<Q", _read_exact(f, 0, 8))
        if n > _MAX_HEADER or 8 + n > size:
            raise PackError(f"{path}: not a safetensors file")
        header = json.loads(_read_exact(f, 8, n))
        header.pop("__metadata__", None)
        h = hashlib.sha256()
        for name, (dtype, shape, start, end) in sorted(_table(header, 8 + n, size).items()):
            buf = _read_exact(f, start, end - start)
            h.update(json.dumps([name, dtype_name(dtype), list(shape), tensor_digest(buf)]).encode())
        return h.hexdigest()


def _version_error(meta: str) -> PackError | None:
    """A pack of another format version: a one-line 're-ingest' / 'upgrade sekv' error, else None."""
    try:
        m = json.loads(meta)
        version = m.get("format_version") if isinstance(m, dict) and m.get("magic") == MAGIC else None
    except ValueError:
        return None
    if type(version) is not int or version in READABLE_VERSIONS:
        return None
    if version > max(READABLE_VERSIONS):
        return PackError(f"pack format version {version} is newer than this sekv reads ({FORMAT_VERSION}); upgrade sekv")
    return PackError(f"pack format version {version} is older than this sekv reads ({FORMAT_VERSION}); re-ingest the document")


# -- the manifest -----------------------------------------------------------------------------------------------

_NAT = ("int", 0, 2**53)
_POS = ("int", 1, 2**53)
_STR = ("str", 4096)
_HEX = ("hex",)
#: what check_manifest requires beyond read_pack's (magic, format_version, method, method_params, tensors)
MANIFEST_SCHEMA: dict[str, Any] = {
    "sekv_version": _STR,
    "model": {
        "id": _STR, "fingerprint": _HEX, "tokenizer_fingerprint": _HEX, "dtype": ("choice", ("float32", "float16", "bfloat16")),
        "shape": {"layers": ("int", 1, 4096), "heads": ("int", 1, 4096), "kv_heads": ("int", 1, 4096), "head_dim": ("int", 1, 4096)},
        "context_window": _NAT,
    },
    "document": {"name": _STR, "kind": ("choice", ("pdf", "txt", "md", "corpus")), "sha256": _HEX, "n_chars": _NAT, "n_pages": _NAT, "token_pages": ("list",)},
    "n_tokens": ("int", 1, 1 << 24),
    "token_ids": ("list",),
    "sizes": {"raw_kv_fp16_bytes": _NAT, "tensor_bytes": _NAT},
    "created": _STR,
}


def _check_value(v: Any, spec: Any, where: str) -> None:
    if isinstance(spec, dict):
        if not isinstance(v, dict):
            raise _damaged(f"manifest field '{where}' is not an object")
        for k, s in spec.items():
            if k not in v:
                raise _damaged(f"manifest field '{where}.{k}' is missing")
            _check_value(v[k], s, f"{where}.{k}")
        return
    kind = spec[0]
    ok = {
        "int": lambda: type(v) is int and spec[1] <= v <= spec[2],
        "str": lambda: isinstance(v, str) and len(v) <= spec[1],
        "hex": lambda: isinstance(v, str) and bool(_HEX64.fullmatch(v)),
        "choice": lambda: v in spec[1] and isinstance(v, str),
        "list": lambda: isinstance(v, list),
    }[kind]()
    if not ok:
        raise _damaged(f"manifest field '{where}' has a bad value ({_short(v)})")


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def check_manifest(pack: Pack) -> None:
    """Every manifest field that ask / chat / inspect read: types and ranges, the token ids and page runs against
    the token count.  PackError naming the field."""
    m = pack.manifest
    try:
        for k, s in MANIFEST_SCHEMA.items():
            if k not in m:
                raise _damaged(f"manifest field '{k}' is missing")
            _check_value(m[k], s, k)
        n = m["n_tokens"]
        ids = m["token_ids"]
        if len(ids) != n or not all(type(t) is int and 0 <= t < 2**31 for t in ids):
            raise _damaged("the manifest's token_ids do not match n_tokens")
        runs = m["document"]["token_pages"]
        pages = m["document"]["n_pages"]
        prev = 0
        for r in runs:
            if (not isinstance(r, list) or len(r) != 3 or not all(type(x) is int for x in r)
                    or not (0 <= r[0] <= pages and prev <= r[1] < r[2] <= n)):
                raise _damaged("the manifest's token -> page map is out of range")
            prev = r[2]
        _check_parts(m["document"], n)
        if "system" in m and not (isinstance(m["system"], str) and len(m["system"]) <= 65536):  # prompt.MAX_SYSTEM_CHARS
            raise _damaged("manifest field 'system' has a bad value (not a text of at most 65536 characters)")
        win = m.get("windows", [[0, n]])  # windowed ingest: the token ranges each window kept, in order
        if (not isinstance(win, list) or not win or not all(isinstance(w, list) and len(w) == 2 and all(type(x) is int for x in w) for w in win)
                or win[0][0] != 0 or win[-1][1] != n or any(a[1] != b[0] for a, b in zip(win, win[1:])) or any(w[0] >= w[1] for w in win if n)):
            raise _damaged("the manifest's windows do not cover the document's tokens in order")
        shape = m["model"]["shape"]
        if shape["heads"] % shape["kv_heads"]:
            raise _damaged("the manifest's model shape is inconsistent (heads not a multiple of kv_heads)")
    except PackError as e:
        raise PackError(f"{pack.path}: {e}") from None


_PART = {"name": _STR, "kind": ("choice", ("pdf", "txt", "md")), "sha256": _HEX, "n_pages": _NAT, "token_start": _NAT, "token_end": _NAT}


def _check_parts(doc: dict, n: int) -> None:
    """document.parts (a corpus's documents, optional): each one's fields, token ranges inside [0, n) in order, pages
    adding up to the corpus's."""
    if "parts" not in doc:
        return
    parts = doc["parts"]
    if not isinstance(parts, list) or not parts or len(parts) > 1 << 20:
        raise _damaged("manifest field 'document.parts' is not a list of documents")
    prev = 0
    for i, part in enumerate(parts):
        _check_value(part, _PART, f"document.parts[{i}]")
        if not prev <= part["token_start"] < part["token_end"] <= n:
            raise _damaged("the manifest's documents (document.parts) do not lie in the tokens in order")
        prev = part["token_end"]
    if sum(p["n_pages"] for p in parts) != doc["n_pages"]:
        raise _damaged("the manifest's documents (document.parts) do not add up to its pages")


def manifest_shape(pack: Pack):
    """The attention shape the pack was made for (from its checked manifest)."""
    from .methods.base import ModelShape

    s = pack.manifest["model"]["shape"]
    return ModelShape(s["layers"], s["heads"], s["kv_heads"], s["head_dim"], getattr(torch, pack.manifest["model"]["dtype"]))


def check_model(pack: Pack, model_id: str, fingerprint: str, tokenizer_fingerprint: str, shape=None) -> None:
    m = pack.manifest.get("model")
    if not isinstance(m, dict) or not all(isinstance(m.get(k), str) for k in ("id", "fingerprint", "tokenizer_fingerprint")):
        raise _damaged(f"{pack.path}: the manifest's model record is missing")
    if m["fingerprint"] != fingerprint:
        raise PackError(
            f"{pack.path}: made with model '{m['id']}' (fingerprint {m['fingerprint'][:12]}), "
            f"but '{model_id}' (fingerprint {fingerprint[:12]}) is loaded; ask with --model {m['id']} or re-ingest"
        )
    if m["tokenizer_fingerprint"] != tokenizer_fingerprint:
        raise PackError(f"{pack.path}: the tokenizer differs from the one the pack was made with; re-ingest the document")
    s = m.get("shape")
    if shape is not None and isinstance(s, dict) and (s.get("layers"), s.get("heads"), s.get("kv_heads"), s.get("head_dim")) != (
        shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.head_dim
    ):
        raise _damaged(f"{pack.path}: the manifest's model shape does not match the model with its fingerprint")


# -- tensor values: the generic checks every method's expectations go through --------------------------------

FLOATS = ("float16", "bfloat16", "float32")
INTS = ("int64", "int32", "int16")


@dataclass(frozen=True)
class TensorSpec:
    """What one tensor (or one per layer, where ``name`` holds ``{l}``) must be.

    ``shape``: ints, dimension names (bound in ``dims``, or bound by the first tensor that names them and then
    required of every other one), or ``"*"`` (any).  ``values``: (lo, hi), every element of an integer tensor in
    [lo, hi] (ints or dimension names); ``increasing``: non-decreasing along the last axis."""

    name: str
    dtypes: tuple[str, ...]
    shape: tuple[int | str, ...]
    optional: bool = False
    values: tuple[int | str, int | str] | None = None
    increasing: bool = False
    finite: bool = False


def check_tensors(store, specs: Iterable[TensorSpec], dims: dict[str, int], n_layers: int = 0) -> dict[str, int]:
    """Check a store's tensors against specs; return the dimensions bound on the way.  PackError on any mismatch.
    Shapes and dtypes come from the header (nothing is read); only ``values`` / ``finite`` specs read tensors."""
    dims = dict(dims)
    names = set(store.keys())
    info = getattr(store, "info", None)
    for spec in specs:
        for layer, name in ([(i, spec.name.format(l=i)) for i in range(n_layers)] if "{l}" in spec.name else [(0, spec.name)]):
            if name not in names:
                if spec.optional:
                    continue
                raise PackError(f"tensor '{name}' is missing; the pack is damaged or incomplete, re-ingest the document")
            if info is not None:
                e = info(name)
                dt, shape = dtype_name(e.dtype), e.shape
            else:
                t = store.get(name)
                dt, shape = dtype_name(t.dtype), tuple(t.shape)
            if dt not in spec.dtypes:
                raise PackError(f"tensor '{name}' is {dt}, expected {' or '.join(spec.dtypes)}; re-ingest the document")
            if len(shape) != len(spec.shape):
                raise PackError(f"tensor '{name}' has {len(shape)} dimensions, expected {len(spec.shape)}; re-ingest the document")
            for got, want in zip(shape, spec.shape):
                if want == "*":
                    continue
                if isinstance(want, str) and "{l}" in want:  # a dimension of its own in every layer
                    want = want.format(l=layer)
                if isinstance(want, str) and want not in dims:
                    dims[want] = got
                exp = dims[want] if isinstance(want, str) else want
                if got != exp:
                    raise PackError(f"tensor '{name}' has shape {list(shape)}, expected {_shape_text(spec.shape, dims, layer)}; re-ingest the document")
            if spec.values is not None or spec.increasing or spec.finite:
                t = store.get(name)
                if spec.finite and t.numel() and not bool(torch.isfinite(t.float()).all()):
                    raise PackError(f"tensor '{name}' holds NaN or infinite values; re-ingest the document")
                if spec.values is not None and t.numel():
                    lo, hi = (dims[x] if isinstance(x, str) else x for x in spec.values)
                    tl = t.long()
                    if int(tl.min()) < lo or int(tl.max()) > hi:
                        raise PackError(f"tensor '{name}' holds values outside [{lo}, {hi}]; re-ingest the document")
                if spec.increasing and t.shape[-1] > 1 and bool((t.long().diff(dim=-1) < 0).any()):
                    raise PackError(f"tensor '{name}' is not in increasing order; re-ingest the document")
    return dims


def _shape_text(shape: tuple, dims: dict[str, int], layer: int = 0) -> str:
    return "[" + ", ".join(str(dims.get(x.format(l=layer), x)) if isinstance(x, str) else str(x) for x in shape) + "]"


def model_dims(shape, n_tokens: int) -> dict[str, int]:
    """The dimension names every spec may use: N tokens, L layers, H heads, Hkv KV heads, d head dim."""
    return {"N": n_tokens, "L": shape.n_layers, "H": shape.n_heads, "Hkv": shape.n_kv_heads, "d": shape.head_dim}
