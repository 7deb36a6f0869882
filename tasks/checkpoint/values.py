"""The values inside a checkpoint's tensor records, taken in the same read as their CRCs.

Every tensor chunk DCP writes is a ``torch.save`` archive: its ``data.pkl`` names the storage's
dtype and its ``data/0`` entry holds the elements. The dtype is read from the pickle's opcodes
(``pickletools``; nothing is unpickled), and as the element bytes pass through the verifier's
buffer each floating-point record gets its element count, NaN and Inf counts, finite min and max
and sum of squares. The CRC-32 of the elements is kept too: it is the record's digest, which
later checkpoints are compared against (``content``).

The fast path is one BLAS dot product, a min and a max per buffer, in numpy on a view of the
buffer (numpy's reductions release the GIL and, on 1 MiB pieces, ran twice as fast as torch's,
whose intra-op threads also compete with the verifier's own threads): the sum of squares is finite
only if no element is NaN or Inf (and none is so large that its square overflows); only then is
the buffer counted element by element. Types numpy lacks (bfloat16, float8) are widened to fp32
by torch first.
"""

from __future__ import annotations

import math
import pickletools
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


@cache
def _torch():
    """torch, and its dtypes by the names torch.save gives them, imported on first use: a
    process that only names a check (a promotion with nothing to verify) does not pay for it.
    torch.save names a storage by its legacy class for the types of ``legacy`` (torch.FloatStorage,
    ...) and by UntypedStorage with the dtype beside it for the others (the float8 types among
    them); numpy reads the types of ``numpy`` as they are, torch widens the others."""
    import torch

    legacy = {
        "DoubleStorage": torch.float64,
        "FloatStorage": torch.float32,
        "HalfStorage": torch.float16,
        "BFloat16Storage": torch.bfloat16,
        "LongStorage": torch.int64,
        "IntStorage": torch.int32,
        "ShortStorage": torch.int16,
        "CharStorage": torch.int8,
        "ByteStorage": torch.uint8,
        "BoolStorage": torch.bool,
    }
    numpy = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}
    return torch, legacy, numpy


_WIDE = (np.float32, np.float64)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@lru_cache(maxsize=4096)
def tensor_dtype(pickled: bytes) -> torch.dtype | None:
    """The storage dtype of a pickled tensor (a ``torch.save`` of one tensor), or None when the
    pickle is not a bare tensor or cannot be walked. Remembered by the pickle's bytes: the chunks
    of one layer's tensors, and the layers of one model, pickle alike (a walk is ~30 us)."""
    names: list[str] = []
    strings: list[str] = []
    try:
        for op, arg, _ in pickletools.genops(pickled):
            if op.name == "GLOBAL":
                names.append(arg.replace(" ", ".", 1))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # a damaged pickle: the CRC check says so, this says only "no tensor"
        return None
    if not names or not names[0].startswith("torch._utils._rebuild_tensor"):
        return None
    torch, legacy, _ = _torch()
    for name in names[1:]:
        module, _, attribute = name.rpartition(".")
        if module == "torch" and attribute in legacy:
            return legacy[attribute]
        if module == "torch" and isinstance(getattr(torch, attribute, None), torch.dtype):
            return getattr(torch, attribute)
    return None


@dataclass
class RecordValues:
    """What one tensor record holds: found in the file, before ``.metadata`` is consulted."""

    offset: int  # the record's offset in its file: how ``.metadata``'s records find it
    dtype: str
    bytes: int
    numel: int
    crc: int = 0  # CRC-32 of the element bytes
    nan: int = 0
    inf: int = 0
    min: float | None = None  # of the finite elements; None when there are none
    max: float | None = None
    sumsq: float = 0.0  # of the finite elements
    value: float | None = None  # the one element of a one-element tensor (a step counter)


class ValueScan:
    """Statistics of one record's element bytes, fed in buffer-sized pieces in file order."""

    def __init__(self, dtype: torch.dtype, record_offset: int, nbytes: int):
        self.dtype = dtype
        self.torch, _, self.numpy_types = _torch()
        self.itemsize = dtype.itemsize
        self.values = RecordValues(record_offset, dtype_name(dtype), nbytes, nbytes // self.itemsize)
        self.floating = dtype.is_floating_point
        self.carry = b""

    def feed(self, piece: memoryview) -> None:
        if self.carry:  # an element split across two buffers
            need = self.itemsize - len(self.carry)
            self.carry += bytes(piece[:need])
            piece = piece[need:]
            if len(self.carry) < self.itemsize:
                return
            self._take(bytearray(self.carry))
            self.carry = b""
        whole = len(piece) - len(piece) % self.itemsize
        if whole:
            self._take(piece[:whole])
        self.carry = bytes(piece[whole:])

    def _take(self, data) -> None:
        if self.values.numel == 1:
            element = self.torch.frombuffer(data, dtype=self.dtype)
            self.values.value = element.double().item() if self.floating else float(element.item())
        if not self.floating:
            return
        if self.dtype in self.numpy_types:
            wide = np.frombuffer(data, dtype=self.numpy_types[self.dtype])
            # Misaligned elements (a piece the reader could not align, see scan._CrcCursor.shift)
            # take numpy's slow loops and no BLAS, 40x slower than a copy to aligned memory.
            if wide.dtype not in _WIDE:
                wide = wide.astype(np.float32)
            elif not wide.flags.aligned:
                wide = wide.copy()
        elif self.dtype is self.torch.bfloat16:
            wide = _widened_bfloat16(np.frombuffer(data, dtype=np.uint16))
        else:
            wide = self.torch.frombuffer(data, dtype=self.dtype).float().numpy()
        with np.errstate(over="ignore", invalid="ignore"):  # a NaN or a huge element: counted below
            total = float(np.dot(wide, wide))
        if not math.isfinite(total):
            nan, inf = np.isnan(wide), np.isinf(wide)
            self.values.nan += int(nan.sum())
            self.values.inf += int(inf.sum())
            wide = wide[~(nan | inf)].astype(np.float64)
            if not wide.size:
                return
            total = float(np.dot(wide, wide))
        v = self.values
        v.sumsq += total
        low, high = float(wide.min()), float(wide.max())
        v.min = low if v.min is None else min(v.min, low)
        v.max = high if v.max is None else max(v.max, high)

    def finish(self, crc: int) -> RecordValues:
        self.values.crc = crc
        return self.values


def _widened_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 elements (as uint16) as float32, exactly: a bfloat16 is a float32's upper half."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def batch(items: list[tuple[torch.dtype, memoryview, int, int]]) -> list[RecordValues]:
    """The values of many small records at once: ``items`` are (dtype, element bytes, record
    offset, CRC). A record's own numpy calls cost some 20 us, more than its elements at the seed's
    scale (a million records of a few KB); here each floating-point dtype's records are joined and
    reduced segment by segment (``reduceat``). A record with a NaN or Inf, a single element (a
    step counter) or a type numpy cannot widen is taken alone, by ``ValueScan``."""
    torch, _, numpy_types = _torch()
    groups: dict = {}
    done = []
    for dtype, piece, offset, crc in items:
        numel = len(piece) // dtype.itemsize
        joinable = dtype in numpy_types or dtype is torch.bfloat16
        if not dtype.is_floating_point or not joinable or numel < 2 or len(piece) % dtype.itemsize:
            done.append(_alone(dtype, piece, offset, crc))
        else:
            groups.setdefault(dtype, []).append((piece, offset, crc))
    for dtype, members in groups.items():
        done.extend(_joined(dtype, members, numpy_types, torch))
    return done


def _alone(dtype, piece, offset: int, crc: int) -> RecordValues:
    scan = ValueScan(dtype, offset, len(piece))
    scan.feed(piece)
    return scan.finish(crc)


def _joined(dtype, members: list, numpy_types: dict, torch) -> list[RecordValues]:
    raw = np.uint16 if dtype is torch.bfloat16 else numpy_types[dtype]
    arrays = [np.frombuffer(piece, dtype=raw) for piece, _, _ in members]
    flat = np.concatenate(arrays)
    if dtype is torch.bfloat16:
        flat = _widened_bfloat16(flat)
    starts = np.cumsum([0] + [len(a) for a in arrays[:-1]])
    with np.errstate(over="ignore", invalid="ignore"):
        wide = flat.astype(np.float64)
        sumsq = np.add.reduceat(wide * wide, starts)
    lows, highs = np.minimum.reduceat(flat, starts), np.maximum.reduceat(flat, starts)
    name = dtype_name(dtype)
    found = []
    for i, (piece, offset, crc) in enumerate(members):
        if not math.isfinite(sumsq[i]):  # a NaN or Inf in it (or a square past float64): alone
            found.append(_alone(dtype, piece, offset, crc))
            continue
        found.append(
            RecordValues(
                offset,
                name,
                len(piece),
                len(arrays[i]),
                crc,
                min=float(lows[i]),
                max=float(highs[i]),
                sumsq=float(sumsq[i]),
            )
        )
    return found
