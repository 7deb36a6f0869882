"""One ``torch.save`` record's zip layout, parsed strictly from bytes already in memory.

Every record DCP writes is a ``torch.save`` archive laid out one way: stored (uncompressed)
entries under one folder, each with a data descriptor (flag bit 3) and a UTF-8 name (bit 11), no
extra fields in the central directory, no comments, a zip64 end record and its locator before
the classic end record. Checking such a record with torch's own reader and Python's ``zipfile``,
as ``scan.plan_crc_ranges`` does, costs about fifty small reads; at the seed's million records
that was most of a verification (issue 37).

``entries`` takes a record's bytes in one piece and accepts exactly that layout, field by field:
every local header agrees with the central directory, every data descriptor with both, the end
records with each other and with where the directory lies. Anything else (a damaged record, or one
merely written another way) gives None, and the caller checks that record the careful way, whose
verdicts and messages are those of torch's reader. So a record this accepts is one both readers
accept too, and the bytes its CRCs cover are the same entries'.
"""

import re
import struct
from dataclasses import dataclass

import numpy as np

_LOCAL = struct.Struct("<4s2B4HL2L2H")  # zipfile.structFileHeader
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # zipfile.structCentralDir
_END = struct.Struct("<4s4H2LH")  # zipfile.structEndArchive
_LOCATOR = struct.Struct("<4sLQL")  # zipfile.structEndArchive64Locator
_END64 = struct.Struct("<4sQ2H2L4Q")  # zipfile.structEndArchive64
_DESCRIPTOR = struct.Struct("<4sLLL")
_CRC = struct.Struct("<L")
_FLAGS = 0x0808  # bits 3 and 11, the only ones torch.save sets
_DOS_DIRECTORY = 0x10
_MAX_PICKLE = 1 << 20
_ELEMENTS = re.compile(rb"^data/\d+$")
_VERSIONS = (1, 10)  # the archive format versions torch's reader supports
# Entries whose bytes are the same in every record one torch writes: a skeleton keeps them.
_CONSTANT = frozenset({b".format_version", b".storage_alignment", b"byteorder", b"version", b".data/version"})
_SKELETONS_PER_LENGTH = 8
_SKELETONS = 4096  # in all: each keeps its header bytes' positions (a few KB), so at most some tens of MB


@dataclass(frozen=True)
class Entry:
    """One entry's stored bytes, ``[start, end)`` within the record, and the CRC they must have."""

    name: str
    start: int
    end: int
    crc: int


@dataclass(frozen=True)
class Layout:
    entries: list[Entry]
    pickled: bytes | None  # data.pkl, when small enough to be a bare tensor's
    elements: list[Entry]  # the data/N entries


def _end_records(data: memoryview) -> tuple[int, int, int] | None:
    """(entries, directory size, directory offset) from the end records, or None."""
    size = len(data)
    if size < _END.size + _LOCATOR.size + _END64.size:
        return None
    sig, disk, disk_cd, count_disk, count, cd_size, cd_offset, comment = _END.unpack_from(
        data, size - _END.size
    )
    if sig != b"PK\x05\x06" or disk or disk_cd or comment or count_disk != count:
        return None
    locator = size - _END.size - _LOCATOR.size
    sig, disk64, end64, disks = _LOCATOR.unpack_from(data, locator)
    if sig != b"PK\x06\x07" or disk64 or disks != 1 or end64 != locator - _END64.size:
        return None
    sig, length, _, _, d, dcd, n_disk, n, size64, offset64 = _END64.unpack_from(data, end64)
    if sig != b"PK\x06\x06" or length != _END64.size - 12 or d or dcd or n_disk != n:
        return None
    if (n, size64, offset64) != (count, cd_size, cd_offset) or offset64 + size64 != end64:
        return None
    return n, size64, offset64


def _entry(data: memoryview, at: int, directory_end: int, limit: int) -> tuple[bytes, Entry, int] | None:
    """The central-directory entry at ``at`` (which ends by ``directory_end``) checked against its
    local header and descriptor, which lie before ``limit``: (name, entry, where the next central
    entry begins), or None."""
    if at + _CENTRAL.size > directory_end:
        return None
    (sig, _, _, _, _, flags, method, _, _, crc, csize, usize, n, extra, comment, disk, _, attrs, header) = (
        _CENTRAL.unpack_from(data, at)
    )
    name = bytes(data[at + _CENTRAL.size : at + _CENTRAL.size + n])
    if sig != b"PK\x01\x02" or flags & ~_FLAGS or method or csize != usize or extra or comment or disk:
        return None
    if attrs & _DOS_DIRECTORY or name.endswith(b"/") or at + _CENTRAL.size + n > directory_end:
        return None
    if header + _LOCAL.size > limit:
        return None
    (lsig, _, _, lflags, lmethod, _, _, lcrc, lcsize, lusize, ln, le) = _LOCAL.unpack_from(data, header)
    start = header + _LOCAL.size + ln + le
    end = start + csize
    if lsig != b"PK\x03\x04" or (lflags, lmethod) != (flags, method) or end > limit:
        return None
    if bytes(data[header + _LOCAL.size : header + _LOCAL.size + ln]) != name:
        return None
    if not flags & 0x08:
        if (lcrc, lcsize, lusize) != (crc, csize, usize):
            return None
    elif end + _DESCRIPTOR.size > limit or _DESCRIPTOR.unpack_from(data, end) != (
        b"PK\x07\x08",
        crc,
        csize,
        usize,
    ):
        return None
    try:
        text = name.decode("utf-8" if flags & 0x800 else "cp437")
    except UnicodeDecodeError:
        return None
    return name, Entry(text, start, end, crc), at + _CENTRAL.size + n


def _version_supported(data: memoryview, found: list[Entry], inner: list[bytes]) -> bool:
    """torch's reader refuses an archive whose format version it does not support
    (caffe2/serialize/versions.h: 1 to 10)."""
    for name in (b".data/version", b"version"):
        if name in inner:
            entry = found[inner.index(name)]
            text = bytes(data[entry.start : entry.end]).strip()
            return text.isdigit() and _VERSIONS[0] <= int(text) <= _VERSIONS[1]
    return False


def entries(data: memoryview) -> Layout | None:
    """The record's entries if ``data`` (the whole record) is laid out exactly as torch.save
    lays out an archive, else None."""
    ends = _end_records(data)
    if ends is None:
        return None
    count, cd_size, at = ends
    limit, directory_end = at, at + cd_size  # entries' data and descriptors lie before the directory
    found, names = [], []
    for _ in range(count):
        parsed = _entry(data, at, directory_end, limit)
        if parsed is None:
            return None
        name, entry, at = parsed
        names.append(name)
        found.append(entry)
    if at != directory_end or len(set(names)) != len(names):
        return None
    folder = names[0].split(b"/", 1)[0] if names else b""
    inner = [n[len(folder) + 1 :] for n in names]
    if not names or any(not n.startswith(folder + b"/") for n in names) or b"data.pkl" not in inner:
        return None
    if not _version_supported(data, found, inner):
        return None
    pickle_entry = found[inner.index(b"data.pkl")]
    small = pickle_entry.end - pickle_entry.start <= _MAX_PICKLE
    pickled = bytes(data[pickle_entry.start : pickle_entry.end]) if small else None
    elements = [e for e, n in zip(found, inner) if _ELEMENTS.match(n)]
    return Layout(found, pickled, elements)


@dataclass(frozen=True)
class _Skeleton:
    """A record ``entries`` accepted, less what differs between records of one shape: the
    contents of its varying entries (the pickle, the elements, the serialization id) and the two
    copies of their CRCs (the central directory's and the data descriptor's)."""

    layout: Layout
    fixed: np.ndarray  # positions of every other byte
    expected: bytes  # their values
    crcs: list[tuple[int, int, int]]  # (entry index, central CRC position, descriptor CRC position)
    pickle_entry: int | None


def _skeleton(data: memoryview, layout: Layout) -> _Skeleton | None:
    size = len(data)
    varying = np.zeros(size, dtype=bool)
    cd_at = _end_records(data)[2]
    crcs, at, pickle_entry = [], cd_at, None
    for i, entry in enumerate(layout.entries):
        fields = _CENTRAL.unpack_from(data, at)
        flags, name_length = fields[5], fields[12]
        inner = bytes(data[at + _CENTRAL.size : at + _CENTRAL.size + name_length]).split(b"/", 1)[-1]
        if not flags & 0x08:
            return None  # the local header's own CRC would vary too: no skeleton, parse each
        if inner == b"data.pkl":
            pickle_entry = i
        if inner not in _CONSTANT:
            varying[entry.start : entry.end] = True
            varying[at + 16 : at + 20] = True  # the central directory's CRC
            varying[entry.end + 4 : entry.end + 8] = True  # the data descriptor's
            crcs.append((i, at + 16, entry.end + 4))
        at += _CENTRAL.size + name_length
    fixed = np.flatnonzero(~varying)
    return _Skeleton(layout, fixed, np.frombuffer(data, dtype=np.uint8)[fixed].tobytes(), crcs, pickle_entry)


class Reader:
    """``entries`` for the records of one verification, remembering the skeleton of each shape of record
    it accepted: a record equal to one of them outside the varying entries, whose two CRC copies
    agree, is accepted with the same entries, as ``entries`` would (it checks nothing else),
    without parsing it again. Half of a verification's per-record time at the seed's scale was
    this parse."""

    def __init__(self):
        self.skeletons: dict[int, list[_Skeleton]] = {}
        self.count = 0

    def entries(self, data: memoryview) -> Layout | None:
        known = self.skeletons.get(len(data), [])
        if known:
            octets = np.frombuffer(data, dtype=np.uint8)
            for skeleton in known:
                if octets[skeleton.fixed].tobytes() == skeleton.expected:
                    layout = _like(data, skeleton)
                    if layout is not None:
                        return layout
        layout = entries(data)
        if layout is not None and len(known) < _SKELETONS_PER_LENGTH and self.count < _SKELETONS:
            skeleton = _skeleton(data, layout)
            if skeleton is not None:
                self.skeletons.setdefault(len(data), []).append(skeleton)
                self.count += 1
        return layout


def _like(data: memoryview, skeleton: _Skeleton) -> Layout | None:
    """The layout of a record that matches ``skeleton``'s fixed bytes, with its own CRCs."""
    found = list(skeleton.layout.entries)
    for i, central, descriptor in skeleton.crcs:
        crc = _CRC.unpack_from(data, central)[0]
        if crc != _CRC.unpack_from(data, descriptor)[0]:
            return None
        e = found[i]
        found[i] = Entry(e.name, e.start, e.end, crc)
    by_start = {e.start: e for e in found}
    pickled = None
    if skeleton.pickle_entry is not None and skeleton.layout.pickled is not None:
        e = found[skeleton.pickle_entry]
        pickled = bytes(data[e.start : e.end])
    return Layout(found, pickled, [by_start[e.start] for e in skeleton.layout.elements])
