"""Reading a checkpoint's data files while its save is still writing others (``verify.overlap_save``).

A job with ``--async-save`` finishes writing long after training moved on, one data file after
another, and ``.metadata`` (which says where every record lies) comes last. Waiting for it before
reading anything puts the whole read after the save. Instead, each ``.distcp`` is read as soon as it
is closed and has not changed for ``settle_seconds``, with the same code as afterwards
(``scan.scan_file``), taking the record boundaries from the file itself: a DCP data file is its
records back to back, each a ``torch.save`` zip whose end-of-central-directory says where it
starts, so they can be walked from the end (PKZIP APPNOTE 4.3.14-4.3.16).

Nothing is judged early. When the save has finished, the verifier takes a file's early reading
only if the file is still exactly what was read (inode, size, mtime) and ``.metadata`` lists the
very records the walk found; otherwise it reads the file again. Promotion still waits for
``metadata.json`` and the whole set, as for any checkpoint.
"""

import os
import stat
import struct
import threading
import time
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.lock import Held
from tasks.checkpoint.scan import FileScan, Record, scan_file, stat_key
from tasks.checkpoint.state import VerifyOptions, wait_until_complete
from tasks.checkpoint.verify import Verification, verify_and_record
from tasks.errors import CkptopsError
from tasks.storage.digest import Hashing
from tasks.storage.local import open_regular

_EOCD = b"PK\x05\x06"
_EOCD_SIZE = 22
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_LOCATOR_SIZE = 20
_ZIP64_EOCD = b"PK\x06\x06"
_ZIP64_EOCD_SIZE = 56  # without extensible data, as torch.save writes it


def walk_records(path: Path) -> list[tuple[int, int]] | None:
    """The (offset, length) of every record in a DCP data file, from its end backwards; None when
    the file is not laid out that way (the early reading is then skipped, never guessed), or is no
    longer a regular file at that name (``open_regular`` refuses it: the reading is skipped too)."""
    found = []
    try:
        opened = open_regular(path, follow=False)
    except CkptopsError:
        return None
    with opened as f:
        end = os.fstat(f.fileno()).st_size
        while end > 0:
            if end < _EOCD_SIZE:
                return None
            eocd = os.pread(f.fileno(), _EOCD_SIZE, end - _EOCD_SIZE)
            if len(eocd) != _EOCD_SIZE or eocd[:4] != _EOCD or struct.unpack("<H", eocd[20:22])[0] != 0:
                return None  # torch.save writes no archive comment
            cd_size, cd_offset = struct.unpack("<II", eocd[12:20])
            locator_at = end - _EOCD_SIZE - _ZIP64_LOCATOR_SIZE
            locator = os.pread(f.fileno(), _ZIP64_LOCATOR_SIZE, locator_at) if locator_at >= 0 else b""
            if locator[:4] == _ZIP64_LOCATOR:
                record_at = locator_at - _ZIP64_EOCD_SIZE
                if os.pread(f.fileno(), 4, record_at) != _ZIP64_EOCD:
                    return None
                start = record_at - struct.unpack("<Q", locator[8:16])[0]
            else:
                start = end - _EOCD_SIZE - cd_size - cd_offset
            if not 0 <= start < end:
                return None
            found.append((start, end - start))
            end = start
    return found[::-1]


class Prescan:
    """Early readings of one checkpoint's data files; ``step`` reads what has settled since."""

    def __init__(self, directory: Path, settle_seconds: float, hashing: Hashing, sha256: bool = False):
        self.directory = Path(directory)
        self.settle_seconds = settle_seconds
        self.hashing = hashing
        self.sha256 = sha256  # the job writes integrity.json: take its SHA-256s on the way
        self.read: dict[str, tuple[list[int], list[tuple[int, int]], FileScan]] = {}
        self._lock = threading.Lock()

    def step(self, deadline: float | None = None) -> list[str]:
        """Read every data file that is closed and settled and not read yet as it is now, until
        ``deadline`` (monotonic); the names read. A file that cannot be read early is left for
        the verification itself, which reads and judges it."""
        done = []
        try:
            entries = sorted(os.scandir(self.directory), key=lambda e: e.name)
        except OSError:
            return done  # the save has not made its directory yet, or it cannot be listed now
        for entry in entries:
            if deadline is not None and time.monotonic() >= deadline:
                break
            if entry.name.endswith(layout.DATA_SUFFIX) and self._read_early(Path(entry.path)):
                done.append(entry.name)
        return done

    def _read_early(self, path: Path) -> bool:
        try:
            st = path.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < self.settle_seconds:
                return False
            if self._have(path.name, st):
                return False
            walked = walk_records(path)
            if walked is None:
                return False
            records = [Record(f"record {i}", path.name, o, n) for i, (o, n) in enumerate(walked)]
            scan = scan_file(path, records, self.sha256, hashing=self.hashing)
            if scan.changed or scan.unreadable is not None or stat_key(path.stat()) != stat_key(st):
                return False
        except (OSError, struct.error):
            return False
        with self._lock:
            self.read[path.name] = (stat_key(st), walked, scan)
        return True

    def _have(self, name: str, st: os.stat_result) -> bool:
        with self._lock:
            return name in self.read and self.read[name][0] == stat_key(st)

    def reuse(self, name: str, records: list[Record]) -> FileScan | None:
        """The early reading of ``name`` if the file is unchanged since and ``.metadata`` lists
        exactly the records found in it; its failures then name the records as ``.metadata`` does."""
        with self._lock:
            kept = self.read.get(name)
        if kept is None:
            return None
        key, walked, scan = kept
        try:
            now = stat_key(os.stat(self.directory / name))
        except OSError:
            return None
        if now != key or walked != sorted((r.offset, r.length) for r in records):
            return None
        if scan.failures:
            return None  # read again with .metadata's record names, for a reason that says which
        return scan


def wait_and_verify(
    directory: Path,
    options: VerifyOptions,
    held: Held,
    timeout_seconds: float,
    poll_seconds: float,
    progress=None,
    watch=None,
) -> Verification:
    """Wait for a save to finish, reading its data files as they settle, then verify it and
    record the verdict (under ``held``, the job lock): the verdict comes seconds after the last
    file instead of a whole read later."""
    prescan = Prescan(directory, options.settle_seconds, options.hashing, options.writes_integrity_json)
    wait_until_complete(directory, options, timeout_seconds, poll_seconds, prescan.step)
    return verify_and_record(directory, options, held, progress, watch=watch, prescan=prescan)
