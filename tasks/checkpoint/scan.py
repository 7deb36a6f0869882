"""One pass over every byte of a checkpoint: per-file hash and every record's CRC together.

DCP has no checksums of its own, but every record it writes (tensor chunk or pickled object) is a
``torch.save`` zip, and a zip keeps a CRC-32 per entry that ``torch.load`` never checks. Checking
those CRCs catches a flipped bit the first time a checkpoint is seen; the XXH3-128 hash of each
file is what later re-verifications, copies and restores compare against.

Why XXH3-128 and not a cryptographic hash: the threat is corruption (bit rot, torn writes, bad
copies), not forgery. The manifest lives beside the data, so whoever can rewrite a shard can
rewrite the manifest too, and a cryptographic hash would buy nothing but time: with BLAKE3 the
pass ran at 1.6x a plain read on the project's 2-core machine, with XXH3-128 at 0.9x.

Why it is shaped like this (measured on the 2-core machine, see README):
- a 1 MiB buffer read with ``preadv`` stays in cache while it is hashed and CRC-checked, so the
  bytes come from memory once; 16 MiB buffers were a third slower;
- stdlib ``zlib.crc32`` runs at 2.3 GB/s, slower than the read itself; ISA-L's runs several
  times faster, and both it and XXH3 release the GIL, so one thread per file uses every core;
- ``mmap`` would be as fast but turns a file truncated under us into SIGBUS, which kills the
  process; a short read is an error we can report;
- records of at most ``SMALL_RECORD`` bytes (most of a large job's: a million of them in the
  seed's index) are read a run at a time before the file's pass and checked whole from memory
  (``torchsave``): one read per run instead of some fifty per record. Their bytes are read twice
  (the second time from the page cache, by the hashing pass), a few percent of a file's bytes
  against most of its per-record cost.
"""

import errno
import hashlib
import os
import re
import stat
import struct
import threading
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from isal import isal_zlib

from tasks.checkpoint import torchsave
from tasks.checkpoint.values import RecordValues, ValueScan, tensor_dtype
from tasks.checkpoint.values import batch as values_batch
from tasks.storage.digest import FileHash, Hashing, combine

WHOLE_FILES = Hashing(segment_bytes=None)  # XXH3-128 of each file as one segment, unless told

WINDOW = 1 << 20
# A record at most this long is read whole and checked from memory (torchsave), in runs of up to
# WINDOW bytes: one read for many records instead of some fifty per record.
SMALL_RECORD = 1 << 16
# Files at least this large are scanned by the thread pool; smaller ones in the calling thread.
PARALLEL_BYTES = 64 << 20
_ALIGN = 64  # bytes: a cache line, and a multiple of every element size
OnBytes = Callable[[int], None]


@dataclass(frozen=True)
class Record:
    """One serialized item in a data file: a tensor chunk or a pickled object."""

    key: str
    file: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class CrcRange:
    """The stored bytes of one zip entry inside one record, with the CRC they must have."""

    start: int
    end: int
    expected: int
    label: str
    crc: int = 0
    values: ValueScan | None = None  # the entry holding a tensor record's elements


@dataclass
class FileScan:
    name: str
    size: int = 0
    hash: str | None = None
    sha256: str | None = None
    records: int = 0
    failures: list[str] = field(default_factory=list)
    changed: bool = False
    unreadable: OSError | None = None  # the environment's fault, not the checkpoint's
    start: int = 0  # the bytes hashed: [start, end); the whole file unless a span was asked for
    end: int = 0
    segments: list[bytes] = field(default_factory=list)
    stat: list[int] | None = None  # inode, size, mtime_ns when the read began
    values: list[RecordValues] = field(default_factory=list)  # each tensor record's, read whole


class _Window:
    """A read-only file object over ``[start, start + length)`` of an open file descriptor, so
    the standard ``zipfile`` can parse one record where it lies, without copying it."""

    def __init__(self, fd: int, start: int, length: int):
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=os.SEEK_SET):
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read(self, n=-1):
        remaining = max(0, self.length - self.pos)
        n = remaining if n is None or n < 0 else min(n, remaining)
        data = os.pread(self.fd, n, self.start + self.pos) if n else b""
        self.pos += len(data)
        return data


# General-purpose flag bits torch.save sets: 3 (sizes and CRC in a data descriptor after the
# data) and 11 (UTF-8 names). Anything else (encryption, patches, ...) is not a torch.save record.
_TORCH_FLAGS = 0x0808
_DESCRIPTOR = b"PK\x07\x08"
_DOS_DIRECTORY = 0x10
_ELEMENTS = re.compile(r"^data/\d+$")
_MAX_PICKLE = 1 << 20  # a bare tensor's data.pkl is a few hundred bytes


def _read_exact(window: _Window, offset: int, size: int, what: str) -> bytes:
    window.seek(offset)
    data = window.read(size)
    if len(data) != size:
        raise zipfile.BadZipFile(f"{what} cut short")
    return data


def _data_start(window: _Window, info: zipfile.ZipInfo) -> int:
    """Where an entry's data begins, after checking that its local header agrees with the
    central directory (PKZIP APPNOTE 4.3.7): a flip in either copy is caught here."""
    header = _read_exact(
        window, info.header_offset, zipfile.sizeFileHeader, f"local header of {info.filename}"
    )
    (signature, _, _, flags, method, _, _, crc, compressed, size, name_length, extra_length) = struct.unpack(
        zipfile.structFileHeader, header
    )
    if signature != zipfile.stringFileHeader:
        raise zipfile.BadZipFile(f"bad local header signature for {info.filename}")
    name = _read_exact(window, info.header_offset + zipfile.sizeFileHeader, name_length, "entry name")
    if (
        name.decode("utf-8", "replace") != info.filename
        or flags != info.flag_bits
        or method != info.compress_type
    ):
        raise zipfile.BadZipFile(f"local header of {info.filename} disagrees with the central directory")
    if not flags & 0x08 and (crc, compressed, size) != (info.CRC, info.compress_size, info.file_size):
        raise zipfile.BadZipFile(f"local header of {info.filename} disagrees with the central directory")
    return info.header_offset + zipfile.sizeFileHeader + name_length + extra_length


def _check_descriptor(window: _Window, info: zipfile.ZipInfo, data_end: int) -> None:
    """The data descriptor after the data repeats CRC and sizes: they must agree too."""
    wide = info.compress_size >= 0xFFFFFFFF or info.file_size >= 0xFFFFFFFF
    fmt = "<LQQ" if wide else "<LLL"
    tail = window.length - data_end
    peek = _read_exact(window, data_end, min(4, tail), f"data descriptor of {info.filename}")
    start = data_end + (4 if peek == _DESCRIPTOR else 0)
    crc, compressed, size = struct.unpack(
        fmt, _read_exact(window, start, struct.calcsize(fmt), f"data descriptor of {info.filename}")
    )
    if (crc, compressed, size) != (info.CRC, info.compress_size, info.file_size):
        raise zipfile.BadZipFile(f"data descriptor of {info.filename} disagrees with the central directory")


def plan_crc_ranges(fd: int, record: Record) -> list[CrcRange]:
    """Check one record's zip structure and return the byte ranges whose CRCs must be checked.

    A torch.save record is an uncompressed zip whose entries all sit under one folder with a
    ``data.pkl``; anything else (compression, encryption, flags torch never sets, a local header
    or data descriptor that disagrees with the central directory) is a damaged record.
    """
    import torch

    window = _Window(fd, record.offset, record.length)
    # First the parser torch.load itself uses (miniz, reading only the directory): whatever it
    # would refuse is damaged, however lenient Python's zipfile is about the same bytes.
    try:
        reader = torch._C.PyTorchFileReader(_Window(fd, record.offset, record.length))
        torch_offsets = {name: reader.get_record_offset(name) for name in reader.get_all_records()}
    except RuntimeError as e:
        raise zipfile.BadZipFile(str(e).split(". ", 1)[0]) from None
    ranges = []
    pickled, elements = None, []
    with zipfile.ZipFile(window) as archive:
        infos = archive.infolist()
        if len(infos) != len(torch_offsets):
            raise zipfile.BadZipFile(
                f"torch's reader sees {len(torch_offsets)} entries, the zip directory {len(infos)}"
            )
        folders = {info.filename.split("/", 1)[0] for info in infos}
        if len(folders) != 1 or f"{next(iter(folders))}/data.pkl" not in archive.NameToInfo:
            raise zipfile.BadZipFile("not laid out like a torch.save archive")
        if archive.comment:
            raise zipfile.BadZipFile("archive has a comment; torch.save never writes one")
        for info in infos:
            # Fields torch.save leaves zero and its reader (miniz) acts on: a disk number makes it
            # refuse the archive, the MS-DOS directory bit makes it skip the entry's data.
            if info.volume or info.comment or info.external_attr & _DOS_DIRECTORY or info.is_dir():
                raise zipfile.BadZipFile(
                    f"entry {info.filename} has disk, comment or directory fields torch.save never sets"
                )
            if info.flag_bits & ~_TORCH_FLAGS:
                raise zipfile.BadZipFile(
                    f"entry {info.filename} has flags {info.flag_bits:#x} torch.save never sets"
                )
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise zipfile.BadZipFile(f"entry {info.filename} is compressed; torch.save never compresses")
            data_start = _data_start(window, info)
            if torch_offsets.get(info.filename.split("/", 1)[-1]) != data_start:
                raise zipfile.BadZipFile(
                    f"entry {info.filename}: torch's reader and the zip directory disagree"
                )
            start = record.offset + data_start
            end = start + info.compress_size
            if end > record.end:
                raise zipfile.BadZipFile(f"entry {info.filename} runs past the record's end")
            if info.flag_bits & 0x08:
                _check_descriptor(window, info, end - record.offset)
            ranges.append(CrcRange(start, end, info.CRC, f"record '{record.key}' entry {info.filename}"))
            inner = info.filename.split("/", 1)[-1]
            if inner == "data.pkl" and info.file_size <= _MAX_PICKLE:
                pickled = _read_exact(window, data_start, info.file_size, info.filename)
            elif _ELEMENTS.match(inner):
                elements.append(ranges[-1])
    # A bare tensor: one storage entry, whose elements are counted as they pass.
    dtype = tensor_dtype(pickled) if pickled is not None and len(elements) == 1 else None
    if dtype is not None:
        (r,) = elements
        r.values = ValueScan(dtype, record.offset, r.end - r.start)
    return ranges


def _fast(reader: torchsave.Reader, view: memoryview, record: Record, scan: FileScan, pending: list) -> bool:
    """Check a small record whose bytes are in ``view`` at once: its layout (``torchsave``) and
    its entries' CRCs; a tensor's elements go to ``pending``, whose statistics are taken together
    (``values.batch``). False when the layout is not exactly torch.save's: the record is then
    planned the careful way."""
    layout = reader.entries(view)
    if layout is None:
        return False
    dtype = tensor_dtype(layout.pickled) if layout.pickled is not None and len(layout.elements) == 1 else None
    for entry in layout.entries:
        piece = view[entry.start : entry.end]
        crc = isal_zlib.crc32(piece)
        if dtype is not None and entry is layout.elements[0]:
            pending.append((dtype, piece, record.offset, crc))
        if crc != entry.crc:  # the label built only here: most records have nothing to report
            label = f"record '{record.key}' entry {entry.name}"
            scan.failures.append(_crc_mismatch(label, record.offset + entry.start, crc, entry.crc))
    return True


def _groups(records: list[Record]):
    """Runs of consecutive small records, each run at most ``WINDOW`` bytes from its first
    record's start to its last one's end, and each large record alone."""
    run: list[Record] = []
    for record in records:
        if run and (record.length > SMALL_RECORD or record.end - run[0].offset > WINDOW):
            yield run
            run = []
        run.append(record)
        if record.length > SMALL_RECORD:
            yield run
            run = []
    if run:
        yield run


def _read_run(fd: int, start: int, end: int) -> memoryview:
    """``[start, end)`` of the file, or as much of it as there is, in writable memory (torch
    widens bfloat16 elements from it, and warns about read-only buffers)."""
    buffer = bytearray(end - start)
    return memoryview(buffer)[: os.preadv(fd, [buffer], start)]


def _plan_file(fd: int, records: list[Record], scan: FileScan, reader: torchsave.Reader) -> list[CrcRange]:
    """Small records are read a run at a time and checked whole from memory; what is left (large
    records, and any whose layout is not exactly torch.save's) is planned for the file's read."""
    ranges, pending = [], []
    for run in _groups(sorted(records, key=lambda r: r.offset)):
        first = run[0]
        data = _read_run(fd, first.offset, run[-1].end) if first.length <= SMALL_RECORD else None
        for record in run:
            view = (
                data[record.offset - first.offset : record.end - first.offset] if data is not None else None
            )
            if view is not None and len(view) == record.length and _fast(reader, view, record, scan, pending):
                continue
            try:
                ranges.extend(plan_crc_ranges(fd, record))
            except OSError:
                raise
            except Exception as e:  # zipfile raises far more than BadZipFile on a damaged archive
                scan.failures.append(
                    f"record '{record.key}' at offset {record.offset} is not a readable torch.save "
                    f"archive ({type(e).__name__}: {e})"
                )
        scan.values.extend(values_batch(pending))  # a run's worth at a time: at most WINDOW bytes
        pending.clear()
    ranges.sort(key=lambda r: r.start)
    return ranges


def _finish(scan: FileScan, r: CrcRange) -> None:
    if r.values is not None:
        scan.values.append(r.values.finish(r.crc))
    if r.crc != r.expected:
        scan.failures.append(_crc_mismatch(r.label, r.start, r.crc, r.expected))


def _crc_mismatch(label: str, start: int, crc: int, expected: int) -> str:
    return f"{label} at offset {start}: CRC {crc:08x}, expected {expected:08x}"


class _CrcCursor:
    """The CRC ranges (sorted by start) a sequential read has reached: each chunk read advances
    the open ones, and a range is judged when the read passes its end."""

    def __init__(self, ranges: list[CrcRange], scan: FileScan):
        self.ranges, self.scan = ranges, scan
        self.next, self.open = 0, []

    def feed(self, chunk: memoryview, pos: int) -> None:
        stop = pos + len(chunk)
        while self.next < len(self.ranges) and self.ranges[self.next].start < stop:
            self.open.append(self.ranges[self.next])
            self.next += 1
        still_open = []
        for r in self.open:
            lo, hi = max(r.start, pos), min(r.end, stop)
            if hi > lo:
                r.crc = isal_zlib.crc32(chunk[lo - pos : hi - pos], r.crc)
                if r.values is not None:
                    r.values.feed(chunk[lo - pos : hi - pos])
            if r.end <= stop:
                _finish(self.scan, r)
            else:
                still_open.append(r)
        self.open = still_open

    def shift(self, pos: int) -> int:
        """Where in the buffer to put the bytes read from ``pos``, so that the elements of the
        tensor record read there (open at ``pos``, or the next one) lie aligned in memory: DCP
        places records at any offset, and numpy's reductions and BLAS need aligned elements."""
        for r in self.open + self.ranges[self.next : self.next + 1]:
            if r.values is not None:
                return (pos - r.start) % _ALIGN
        return 0

    def close(self, pos: int) -> None:
        """The read ended at ``pos``: ranges it did not reach the end of are failures."""
        for r in self.open + self.ranges[self.next :]:
            if r.end <= pos:  # empty entries at the very end
                _finish(self.scan, r)
            else:
                self.scan.failures.append(
                    f"{r.label}: file ends at byte {pos}, before the entry's end {r.end}"
                )


def stat_key(st: os.stat_result) -> list[int]:
    """What identifies one version of a file: inode, size and mtime (the same on every node of a
    shared file system, so a shard task's and the coordinator's can be compared)."""
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def owned_records(records: list[Record], start: int, end: int, last: bool) -> list[Record]:
    """The records a span ``[start, end)`` of a file checks: those that begin inside it (the last
    span also takes any that begin past the file's end, so that every record is checked once)."""
    return [r for r in records if start <= r.offset and (r.offset < end or last)]


def _open_listed(path: Path, scan: FileScan) -> int | None:
    """A file listed as a regular one, opened to read: without following a link or blocking on
    a FIFO put in its place since (the scan is then ``changed``: not what was listed), nor read
    unless it still is a regular file. None, with the scan saying why, where it is not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        scan.changed = True  # listed a moment ago: a writer is still at work
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            scan.changed = True
        else:
            scan.unreadable = e
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        scan.changed = True
        return None
    os.set_blocking(fd, True)
    return fd


def scan_file(
    path: Path,
    records: list[Record],
    want_sha256: bool = False,
    progress: OnBytes | None = None,
    hashing: Hashing = WHOLE_FILES,
    span: tuple[int, int] | None = None,
    uncached: bool = False,
    reader: torchsave.Reader | None = None,
    name: str | None = None,
) -> FileScan:
    """Hash ``path`` (``name`` in the checkpoint, if not its own: ``tokenizer/vocab.json``) and
    check the CRCs of ``records`` in it, reading each byte once. With ``span`` (segment bounds,
    ``end`` the planned size for the last span) only those bytes are hashed, into segment digests
    the caller combines with the other spans'; the CRCs of ``records`` (the span's own) are checked
    whole, reading past ``end`` where a record runs on; the file must still have its planned size.
    ``uncached`` drops this host's cached pages of the span first, so the bytes come from storage;
    ``reader``, shared by the files of one verification, remembers the shapes of record seen."""
    scan = FileScan(name or path.name, records=len(records))
    if span is not None:
        scan.start, scan.end = span  # what was asked for, even when the file is not there to read
    fd = _open_listed(path, scan)
    if fd is None:
        return scan
    try:
        before = os.fstat(fd)
        scan.size = before.st_size
        start, end = span or (0, before.st_size)
        if span is not None and before.st_size < end:
            scan.changed = True  # shorter than when the spans were planned: a writer is at work
            return scan
        if uncached:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, start, 0, os.POSIX_FADV_SEQUENTIAL)
        ranges = _plan_file(fd, records, scan, reader or torchsave.Reader())
        hasher = FileHash(hashing, start)
        sha = hashlib.sha256() if want_sha256 else None
        buffer = bytearray(WINDOW + _ALIGN)
        view = memoryview(buffer)
        # Past the span's end only to finish the CRCs of records it owns; a whole file to its EOF.
        stop_at = max([end, *(r.end for r in ranges)]) if span else None
        crcs = _CrcCursor(ranges, scan)
        pos = start
        while stop_at is None or pos < stop_at:
            shift = crcs.shift(pos)
            length = WINDOW if stop_at is None else min(WINDOW, stop_at - pos)
            n = os.preadv(fd, [view[shift : shift + length]], pos)
            if n == 0:
                break
            chunk = view[shift : shift + n]
            hashed = chunk[: max(0, end - pos)] if span else chunk
            if hashed:
                hasher.update(hashed)
                if sha is not None:
                    sha.update(hashed)
            crcs.feed(chunk, pos)
            pos += n
            if progress:
                progress(n)
        crcs.close(pos)
        scan.start, scan.end = start, end if span else hasher.position
        scan.segments = hasher.finish()
        scan.hash = combine(scan.segments, hashing.algorithm) if span is None else None
        scan.sha256 = sha.hexdigest() if sha is not None else None
        scan.stat = stat_key(before)
        scan.changed = stat_key(os.fstat(fd)) != stat_key(before) or hasher.position != end
        try:
            scan.changed = scan.changed or stat_key(os.stat(path)) != stat_key(before)
        except FileNotFoundError:
            scan.changed = True
    except OSError as e:
        scan.unreadable = e
    finally:
        os.close(fd)
    return scan


def scan_files(
    directory: Path,
    files: dict[str, list[Record]],
    sha256_for: set[str] = frozenset(),
    threads: int = 0,
    progress: OnBytes | None = None,
    hashing: Hashing = WHOLE_FILES,
) -> dict[str, FileScan]:
    """Scan many files: the large ones in parallel, largest first so the last thread does not
    start last; the small ones in this thread meanwhile. A small file's time is per-record
    Python, which holds the interpreter lock: threads only traded it (at 5,120 files and a
    million records, 279 s with two threads against 216 s in one, issue 37). A large file's time
    is hashing and CRCs, which release it."""
    threads = threads or os.cpu_count() or 1
    lock = threading.Lock()
    reader = torchsave.Reader()

    def locked_progress(n):
        with lock:
            progress(n)

    def size_of(name):
        try:
            return (directory / name).stat().st_size
        except OSError:
            return 0

    def one(name):
        return scan_file(
            directory / name,
            files[name],
            name in sha256_for,
            locked_progress if progress else None,
            hashing,
            reader=reader,
            name=name,
        )

    sizes = {name: size_of(name) for name in files}
    order = sorted(files, key=sizes.get, reverse=True)
    large = [name for name in order if sizes[name] >= PARALLEL_BYTES]
    with ThreadPoolExecutor(max_workers=min(threads, max(1, len(large)))) as pool:
        pending = [pool.submit(one, name) for name in large]
        scans = [one(name) for name in order if sizes[name] < PARALLEL_BYTES]
        scans += [future.result() for future in pending]
    return {scan.name: scan for scan in scans}
