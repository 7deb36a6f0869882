"""One pass over every byte of a checkpoint: per-file hash and every record's CRC together.

DCP has no checksums of its own, but every record it writes (tensor chunk or pickled object) is a
``torch.save`` zip, and a zip keeps a CRC-32 per entry that ``torch.load`` never checks. Checking
those CRCs catches a flipped bit the first time a checkpoint is seen; the BLAKE3 hash of each
file is what later re-verifications, copies and restores compare against.

Why it is shaped like this (measured on the 2-core machine, see README):
- a 1 MiB buffer read with ``preadv`` stays in cache while it is hashed and CRC-checked, so the
  bytes come from memory once; 16 MiB buffers were a third slower;
- stdlib ``zlib.crc32`` runs at 2.3 GB/s, slower than the read itself; ISA-L's runs several
  times faster, and both it and BLAKE3 release the GIL, so one thread per file uses every core;
- ``mmap`` would be as fast but turns a file truncated under us into SIGBUS, which kills the
  process; a short read is an error we can report.
"""

import hashlib
import os
import struct
import threading
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import blake3
from isal import isal_zlib

from tasks.checkpoint.dcp import Record

WINDOW = 1 << 20
Progress = Callable[[int], None]


@dataclass
class CrcRange:
    """The stored bytes of one zip entry inside one record, with the CRC they must have."""

    start: int
    end: int
    expected: int
    label: str
    crc: int = 0


@dataclass
class FileScan:
    name: str
    size: int = 0
    blake3: str | None = None
    sha256: str | None = None
    records: int = 0
    failures: list[str] = field(default_factory=list)
    changed: bool = False
    error: str | None = None


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


def _local_header_size(window: _Window, info: zipfile.ZipInfo) -> int:
    """Bytes between an entry's local header offset and its data (PKZIP APPNOTE 4.3.7)."""
    window.seek(info.header_offset)
    header = window.read(zipfile.sizeFileHeader)
    if len(header) != zipfile.sizeFileHeader:
        raise zipfile.BadZipFile(f"local header of {info.filename} cut short")
    fields = struct.unpack(zipfile.structFileHeader, header)
    if fields[0] != zipfile.stringFileHeader:
        raise zipfile.BadZipFile(f"bad local header signature for {info.filename}")
    name_length, extra_length = fields[10], fields[11]
    return zipfile.sizeFileHeader + name_length + extra_length


def plan_crc_ranges(fd: int, record: Record) -> list[CrcRange]:
    """Read one record's zip directory and return the byte ranges whose CRCs must be checked."""
    window = _Window(fd, record.offset, record.length)
    ranges = []
    with zipfile.ZipFile(window) as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                # torch.save never compresses; a compressed entry is checked the slow way.
                bad = archive.testzip()
                if bad:
                    raise zipfile.BadZipFile(f"entry {bad} fails its CRC")
                return []
            start = record.offset + info.header_offset + _local_header_size(window, info)
            end = start + info.compress_size
            if end > record.end:
                raise zipfile.BadZipFile(f"entry {info.filename} runs past the record's end")
            ranges.append(CrcRange(start, end, info.CRC, f"record '{record.key}' entry {info.filename}"))
    return ranges


def _plan_file(fd: int, records: list[Record], scan: FileScan) -> list[CrcRange]:
    ranges = []
    for record in records:
        try:
            ranges.extend(plan_crc_ranges(fd, record))
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
            scan.failures.append(
                f"record '{record.key}' at offset {record.offset} is not a readable torch.save "
                f"archive ({e})"
            )
    ranges.sort(key=lambda r: r.start)
    return ranges


def _finish(scan: FileScan, r: CrcRange) -> None:
    if r.crc != r.expected:
        scan.failures.append(
            f"{r.label} at offset {r.start}: CRC {r.crc:08x}, expected {r.expected:08x}"
        )


def _stat_key(st: os.stat_result) -> tuple:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def scan_file(path: Path, records: list[Record], want_sha256: bool = False,
              progress: Progress | None = None) -> FileScan:
    """Hash ``path`` and check the CRCs of ``records`` in it, reading each byte once."""
    scan = FileScan(path.name, records=len(records))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        scan.error = f"cannot open ({e.strerror})"
        return scan
    try:
        before = os.fstat(fd)
        scan.size = before.st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        ranges = _plan_file(fd, records, scan)
        hasher = blake3.blake3()
        sha = hashlib.sha256() if want_sha256 else None
        buffer = bytearray(WINDOW)
        view = memoryview(buffer)
        pos, next_range, open_ranges = 0, 0, []
        while True:
            n = os.preadv(fd, [buffer], pos)
            if n == 0:
                break
            chunk = view[:n]
            hasher.update(chunk)
            if sha is not None:
                sha.update(chunk)
            stop = pos + n
            while next_range < len(ranges) and ranges[next_range].start < stop:
                open_ranges.append(ranges[next_range])
                next_range += 1
            still_open = []
            for r in open_ranges:
                lo, hi = max(r.start, pos), min(r.end, stop)
                if hi > lo:
                    r.crc = isal_zlib.crc32(chunk[lo - pos:hi - pos], r.crc)
                if r.end <= stop:
                    _finish(scan, r)
                else:
                    still_open.append(r)
            open_ranges = still_open
            pos = stop
            if progress:
                progress(n)
        for r in open_ranges + ranges[next_range:]:
            if r.end <= pos:  # empty entries at the very end
                _finish(scan, r)
            else:
                scan.failures.append(f"{r.label}: file ends at byte {pos}, before the entry's end {r.end}")
        scan.blake3 = hasher.hexdigest()
        scan.sha256 = sha.hexdigest() if sha is not None else None
        scan.changed = _stat_key(os.fstat(fd)) != _stat_key(before) or pos != before.st_size
        try:
            scan.changed = scan.changed or _stat_key(os.stat(path)) != _stat_key(before)
        except FileNotFoundError:
            scan.changed = True
    except OSError as e:
        scan.error = f"read failed ({e.strerror})"
    finally:
        os.close(fd)
    return scan


def scan_files(directory: Path, files: dict[str, list[Record]], sha256_for: set[str] = frozenset(),
               threads: int = 0, progress: Progress | None = None) -> dict[str, FileScan]:
    """Scan many files in parallel, largest first so the last thread does not start last."""
    threads = threads or os.cpu_count() or 1
    lock = threading.Lock()

    def locked_progress(n):
        with lock:
            progress(n)

    def size_of(name):
        try:
            return (directory / name).stat().st_size
        except OSError:
            return 0

    order = sorted(files, key=size_of, reverse=True)
    with ThreadPoolExecutor(max_workers=min(threads, max(1, len(order)))) as pool:
        results = pool.map(
            lambda name: scan_file(directory / name, files[name], name in sha256_for,
                                   locked_progress if progress else None),
            order,
        )
        return {scan.name: scan for scan in results}
