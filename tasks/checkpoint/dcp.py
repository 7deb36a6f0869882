"""Reading a torch_dist checkpoint's index and small objects without trusting its pickles.

PyTorch DCP keeps its index in ``.metadata``, a pickle, and DCP's own reader unpickles it with
no restriction. Megatron stores its common state (args, iteration, scheduler) as a pickled object
inside the data files. Neither is loaded with full unpickling here: ``.metadata`` goes through an
allowlist of DCP's own dataclasses and torch's dtypes, and the common state through
``torch.load(weights_only=True)`` with megatron-core's own safe-globals list.

Neither is trusted either (``tasks.storage.bounded``'s policy): each is read only from a regular
file at its own name (a FIFO would block for ever, a link may point anywhere), and no larger than
what the checkpoint's own files make possible. ``.metadata`` is read whole before it is
unpickled, no larger than the data files it indexes (each record's bytes outweigh its entry in the
index); once unpickled, and before anything walks it, every record must name a data file in the
checkpoint directory with integer bounds, and every tensor hold no more chunks than it has
elements, nor all tensors more chunks than there are records. A violation fails the
``dcp-metadata`` check in one line naming the file, the record or tensor, and the limit.

torch is imported when something is read, not with this module: what only names a check or
an error from here (a promotion that finds nothing to verify, a flow run's start) does not pay
for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import gc
import io
import logging
import math
import os
import pickle
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from tasks.checkpoint import layout
from tasks.checkpoint.checks import VerifyCheck
from tasks.checkpoint.scan import Record
from tasks.errors import CkptopsError, Malformed, Unreadable, UsageError, unreadable
from tasks.storage.bounded import read_bounded
from tasks.storage.local import list_files, open_regular

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

_DCP_MODULES = ("torch.distributed.checkpoint.", "megatron.core.dist_checkpointing.")
# torch's own FileSystemWriter records its checkpoint_id as a pathlib path of strings (a plain
# ``torch.distributed.checkpoint.save``; Megatron's writer records a str); building one reads nothing.
_EXPLICIT = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),
}
# An object shard's grid offset and shape: dot-separated numbers of at most 18 digits each.
_SHARD_KEY = re.compile(
    r"^(?P<family>.+)/shard_(?P<offset>\d{1,18}(?:\.\d{1,18})*)_(?P<shape>\d{1,18}(?:\.\d{1,18})*)$", re.ASCII
)
# Room for an index beside next to no data (a checkpoint of a few tiny tensors).
_INDEX_FLOOR = 1 << 20
_COMMON_LIMIT = 256 << 20  # common.pt: the args, scheduler and optimizer groups, some MB at most
_MAX_INT = (1 << 63) - 1  # a file offset, a length, a dimension: what a signed 64-bit integer holds


class CheckFailed(CkptopsError):
    """One check failed; ``file`` and ``check`` say where, the message says what."""

    def __init__(self, check: VerifyCheck, file: str | None, detail: str):
        self.check, self.file, self.detail = check, file, detail
        where = f"{file}: " if file else ""
        super().__init__(f"{where}{detail} [{check}]")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata dataclasses and enums, torch.Size, and torch dtype constants."""

    def find_class(self, module, name):
        import torch

        if (module, name) in _EXPLICIT:
            return super().find_class(module, name)
        constants = (torch.dtype, torch.layout, torch.memory_format)
        if module == "torch" and isinstance(getattr(torch, name, None), constants):
            return getattr(torch, name)
        if module.startswith(_DCP_MODULES):
            cls = super().find_class(module, name)
            if isinstance(cls, type) and (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
                return cls
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


@contextmanager
def collector_off():
    """The garbage collector paused: unpickling a million records makes millions of objects, none
    of them garbage, and the collections they trigger took two thirds of the time (issue 37); every
    later collection in the verification walked them all again. Nested uses leave it to the
    outermost; reference counting still frees what is not in a cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def index_limit(directory: Path, files: dict[str, os.stat_result] | None = None) -> int:
    """The most bytes ``.metadata`` may have: the size of the data files beside it (each record
    it indexes is a ``torch.save`` archive of some hundred bytes at least, its entry in the index
    fewer), and 1 MiB more. ``files``: the directory's listing, where the caller has it."""
    files = list_files(directory) if files is None else files
    return _INDEX_FLOOR + sum(st.st_size for name, st in files.items() if name.endswith(layout.DATA_SUFFIX))


def load_dcp_metadata(path: Path, limit: int | None = None) -> Metadata:
    """Unpickle a DCP ``.metadata`` file through the allowlist: read whole from a regular file at
    that name, at most ``limit`` bytes (``index_limit`` of its directory), and checked
    (``check_index``) before anything walks it."""
    path = Path(path)
    limit = index_limit(path.parent) if limit is None else limit
    data = _read_index(path, limit)
    try:
        with collector_off():
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # a garbled pickle can raise nearly anything
        raise CheckFailed(
            VerifyCheck.DCP_METADATA, path.name, f"unreadable ({type(e).__name__}: {e})"
        ) from None
    check_index(metadata, path.name)
    return metadata


def _read_index(path: Path, limit: int) -> bytes:
    """``.metadata``'s bytes, at most ``limit``; read asking for no more than the file holds (a
    read of ``limit`` bytes, terabytes beside a large checkpoint, would reserve them first)."""
    try:
        size = os.lstat(path).st_size
    except FileNotFoundError:
        raise CheckFailed(VerifyCheck.DCP_METADATA, path.name, "missing") from None
    except OSError as e:
        raise unreadable(path, e) from None
    try:
        return read_bounded(path, min(limit, size), "the DCP index", follow=False)
    except Unreadable:
        if not os.path.lexists(path):
            raise CheckFailed(VerifyCheck.DCP_METADATA, path.name, "missing") from None
        raise
    except UsageError as e:  # a FIFO, a device, a directory, a link
        kind = str(e).removeprefix(f"{path}: ").split(";")[0]
        raise CheckFailed(VerifyCheck.DCP_METADATA, path.name, f"{kind}; refused") from None
    except Malformed:
        if size <= limit:  # it grew as it was read: not the index that was listed
            raise CheckFailed(VerifyCheck.DCP_METADATA, path.name, "changed while being read") from None
        raise CheckFailed(
            VerifyCheck.DCP_METADATA,
            path.name,
            f"{size:,} bytes, more than the {limit:,} the data files beside it allow (their size and "
            "1 MiB); refused",
        ) from None


def check_index(metadata, name: str) -> None:
    """Refuse an unpickled index that is not DCP's ``Metadata`` as its writer makes it: records
    naming a data file of the checkpoint directory with integer offsets and lengths, tensors of
    integer shapes with no more chunks than elements, and no more chunks in all than records
    (each chunk has its own). Counts are checked before the items are walked one by one."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckFailed(VerifyCheck.DCP_METADATA, name, "not a DCP Metadata object with storage data")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise CheckFailed(VerifyCheck.DCP_METADATA, name, "not a DCP Metadata object with an item list")
    records = len(metadata.storage_data)
    chunks = 0
    for fqn, item in metadata.state_dict_metadata.items():
        if hasattr(item, "chunks"):
            chunks += _check_tensor(fqn, item, name)
    if chunks > records:
        raise CheckFailed(
            VerifyCheck.DCP_METADATA,
            name,
            f"{chunks:,} tensor chunks but {records:,} records: each chunk has a record of its own; refused",
        )
    for index, info in metadata.storage_data.items():
        _check_record(index, info, name)


def _check_tensor(fqn, item, name: str) -> int:
    """The number of chunks of tensor ``fqn``, refused past its elements or with a shape or a
    chunk that is not integers of its dimensions."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    label = f"tensor {str(fqn)[:200]!r}"
    size, chunks = getattr(item, "size", None), item.chunks
    if not isinstance(size, tuple) or not all(type(d) is int and 0 <= d <= _MAX_INT for d in size):
        raise CheckFailed(
            VerifyCheck.DCP_METADATA, name, f"{label} has shape {str(size)[:80]}, not sizes; refused"
        )
    if not isinstance(chunks, list):
        raise CheckFailed(VerifyCheck.DCP_METADATA, name, f"{label} has no chunk list; refused")
    elements = max(1, math.prod(size))
    if len(chunks) > elements:
        raise CheckFailed(
            VerifyCheck.DCP_METADATA,
            name,
            f"{label} has {len(chunks):,} chunks, more than its {elements:,} elements; refused",
        )
    dimensions = len(size)
    if dimensions == 0:
        _check_scalar(label, chunks, name)
        return len(chunks)
    try:
        ranks = {(type(c), len(c.offsets), len(c.sizes)) for c in chunks}
        same = ranks == {(ChunkStorageMetadata, dimensions, dimensions)}
        kinds = {type(x) for c in chunks for x in (*c.offsets, *c.sizes)} if same else set()
    except (AttributeError, TypeError):
        kinds = set()
    if chunks and kinds != {int}:
        raise CheckFailed(
            VerifyCheck.DCP_METADATA,
            name,
            f"{label}: a chunk that is not {dimensions} integer offsets and sizes; refused",
        )
    return len(chunks)


def _check_scalar(label: str, chunks: list, name: str) -> None:
    """A 0-dim tensor's chunks: exactly one, with no offsets and no sizes (its one element)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    try:
        empty = all(type(c) is ChunkStorageMetadata and len(c.offsets) == len(c.sizes) == 0 for c in chunks)
    except (AttributeError, TypeError):
        empty = False
    if len(chunks) != 1 or not empty:
        raise CheckFailed(
            VerifyCheck.DCP_METADATA,
            name,
            f"{label} is a scalar but has not exactly 1 chunk with no offsets and sizes; refused",
        )


def _check_record(index, info, name: str) -> None:
    """A storage record: its key a name and an optional offset, its place a data file of the
    checkpoint directory (a plain ``*.distcp`` name) at integer bounds."""
    fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
    label = f"record {str(fqn)[:200]!r}"
    if not isinstance(fqn, str) or not (
        offset is None or (isinstance(offset, tuple) and all(type(o) is int for o in offset))
    ):
        raise CheckFailed(VerifyCheck.DCP_METADATA, name, f"{label} has no name and offset; refused")
    file = getattr(info, "relative_path", None)
    if not is_data_file_name(file):
        raise CheckFailed(
            VerifyCheck.DCP_METADATA,
            name,
            f"{label} names the file {str(file)[:200]!r}, not a data file in the checkpoint "
            "directory; refused",
        )
    for field in ("offset", "length"):
        value = getattr(info, field, None)
        if type(value) is not int or not 0 <= value <= _MAX_INT:
            raise CheckFailed(
                VerifyCheck.DCP_METADATA,
                name,
                f"{label} has {field} {str(value)[:40]}, not an integer in 0..{_MAX_INT:,}; refused",
            )


def is_data_file_name(file) -> bool:
    """Whether ``file`` is a data file's name directly in the checkpoint directory: a plain
    ``*.distcp`` name, nothing that leads out of it."""
    return (
        isinstance(file, str)
        and file.endswith(layout.DATA_SUFFIX)
        and "/" not in file
        and "\\" not in file
        and "\x00" not in file
    )


@dataclass(frozen=True)
class ObjectShard:
    family: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass
class DcpIndex:
    metadata: Metadata
    tensors: dict[str, TensorStorageMetadata]
    objects: dict[str, BytesStorageMetadata]
    records: dict[tuple[str, tuple[int, ...] | None], Record]

    @cached_property
    def files(self) -> dict[str, list[Record]]:
        """Records grouped by data file, each list in file order."""
        grouped: dict[str, list[Record]] = {}
        for record in self.records.values():
            grouped.setdefault(record.file, []).append(record)
        for records in grouped.values():
            records.sort(key=lambda r: r.offset)
        return grouped

    def object_shards(self) -> list[ObjectShard]:
        shards = []
        for key in self.objects:
            match = _SHARD_KEY.match(key)
            if match:
                shards.append(
                    ObjectShard(
                        match["family"],
                        tuple(int(x) for x in match["offset"].split(".")),
                        tuple(int(x) for x in match["shape"].split(".")),
                    )
                )
        return shards


def build_index(metadata: Metadata) -> DcpIndex:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    tensors, objects = {}, {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            tensors[fqn] = item
        elif isinstance(item, BytesStorageMetadata):
            objects[fqn] = item
    records = {}
    for index, info in metadata.storage_data.items():
        offset = None if index.offset is None else tuple(index.offset)
        label = index.fqn if offset is None else f"{index.fqn}@{list(offset)}"
        records[(index.fqn, offset)] = Record(label, info.relative_path, int(info.offset), int(info.length))
    return DcpIndex(metadata, tensors, objects, records)


def read_record(directory: Path, record: Record) -> bytes:
    """A record's bytes from its data file (a regular file at that name, in ``directory``),
    refused where the record lies past the file's end."""
    if not is_data_file_name(record.file):
        raise CheckFailed(
            VerifyCheck.RECORDS, record.file, f"record '{record.key}' lies outside the checkpoint"
        )
    path = directory / record.file
    try:
        with open_regular(path, follow=False) as f:
            size = os.fstat(f.fileno()).st_size
            if record.offset < 0 or record.length < 0 or record.offset + record.length > size:
                raise CheckFailed(VerifyCheck.FILES, record.file, f"record '{record.key}' is cut short")
            data = os.pread(f.fileno(), record.length, record.offset)
    except Unreadable:
        if not os.path.lexists(path):
            raise CheckFailed(VerifyCheck.FILES, record.file, f"missing, it holds '{record.key}'") from None
        raise
    except UsageError as e:
        kind = str(e).removeprefix(f"{path}: ").split(";")[0]
        raise CheckFailed(VerifyCheck.FILES, record.file, f"{kind}; refused") from None
    except OSError as e:
        raise unreadable(path, e) from None
    if len(data) != record.length:
        raise CheckFailed(VerifyCheck.FILES, record.file, f"record '{record.key}' is cut short")
    return data


_STDLIB_SAFE = [argparse.Namespace, SimpleNamespace]


def load_common_state(directory: Path, index: DcpIndex) -> dict:
    """Megatron's common state (args, iteration, scheduler, optimizer groups), loaded safely.

    Megatron >= 0.19 keeps it as the sharded object ``common_state/shard_0_1``; <= 0.18 in
    ``common.pt``. The stdlib types cover most jobs without importing megatron (7 s); args that
    hold megatron's enums need megatron-core's own allowlist, imported only then.
    """
    record = index.records.get(("common_state/shard_0_1", None))
    if record is not None:
        source, name = io.BytesIO(read_record(directory, record)), record.file
    elif os.path.lexists(directory / "common.pt"):
        source, name = io.BytesIO(_read_common(directory / "common.pt")), "common.pt"
    else:
        raise CheckFailed(
            VerifyCheck.STATE, None, "no common state (neither common_state/shard_0_1 nor common.pt)"
        )
    loaded = weights_only_load(source, name)
    if record is not None:  # megatron stores the list of the object's shards' data
        loaded = loaded[0] if isinstance(loaded, list) and loaded else loaded
    if not isinstance(loaded, dict):
        raise CheckFailed(VerifyCheck.STATE, name, f"common state is a {type(loaded).__name__}, not a dict")
    return loaded


def _read_common(path: Path) -> bytes:
    """``common.pt`` (megatron-core 0.18 and older): a regular file at that name, bounded."""
    try:
        return read_bounded(path, _COMMON_LIMIT, "the common state", follow=False)
    except (UsageError, Malformed) as e:
        raise CheckFailed(
            VerifyCheck.STATE, path.name, str(e).removeprefix(f"{path}: ").split(";")[0] + "; refused"
        ) from None


def load_object(directory: Path, index: DcpIndex, key: str):
    """One small sharded object (a data-parallel group's optimizer param groups), loaded safely;
    megatron stores the list of the object's shards' data."""
    record = index.records[(key, None)]
    loaded = weights_only_load(io.BytesIO(read_record(directory, record)), record.file)
    return loaded[0] if isinstance(loaded, list) and len(loaded) == 1 else loaded


def _stored_only(source: io.BytesIO, name: str) -> None:
    """``torch.save`` stores its archive's entries uncompressed: an entry compressed, or larger
    than the bytes that hold it, is refused before torch's reader inflates it."""
    import zipfile

    try:
        with zipfile.ZipFile(source) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        return  # not a zip archive: torch's own reader judges it
    size = len(source.getbuffer())
    if any(e.compress_type != zipfile.ZIP_STORED or e.file_size > size for e in entries):
        raise CheckFailed(
            VerifyCheck.STATE, name, f"an archive entry compressed or larger than its {size:,} bytes; refused"
        )


def weights_only_load(source, name: str):
    """``source`` (the bytes of a ``torch.save`` archive) loaded with the safe loader."""
    import torch

    if isinstance(source, io.BytesIO):
        _stored_only(source, name)

    def attempt():
        if isinstance(source, io.BytesIO):
            source.seek(0)
        with torch.serialization.safe_globals(_STDLIB_SAFE):
            return torch.load(source, weights_only=True, map_location="cpu")

    try:
        return attempt()
    except pickle.UnpicklingError:
        # Megatron warns about every optional extra it lacks, and torch logs that a machine
        # without CUDA has no CUDA runtime: neither belongs in a verifier's output.
        cpp = logging.getLogger("torch.utils.cpp_extension")
        level = cpp.level
        cpp.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import megatron.core.safe_globals as megatron_safe
        finally:
            cpp.setLevel(level)

        megatron_safe.register_safe_globals()
    except Exception as e:
        raise CheckFailed(VerifyCheck.STATE, name, f"common state unreadable ({type(e).__name__})") from None
    try:
        return attempt()
    except Exception as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        hint = f"unsupported global {found.group(1)}" if found else type(e).__name__
        raise CheckFailed(
            VerifyCheck.STATE, name, f"common state refused by the safe loader ({hint})"
        ) from None
