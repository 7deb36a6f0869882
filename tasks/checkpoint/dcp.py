"""Reading a torch_dist checkpoint's index and small objects without trusting its pickles.

PyTorch DCP keeps its index in ``.metadata``, a pickle, and DCP's own reader unpickles it with
no restriction. Megatron stores its common state (args, iteration, scheduler) as a pickled object
inside the data files. Neither is loaded with full unpickling here: ``.metadata`` goes through an
allowlist of DCP's own dataclasses and torch's dtypes, and the common state through
``torch.load(weights_only=True)`` with megatron-core's own safe-globals list.

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

from tasks.checkpoint.checks import VerifyCheck
from tasks.checkpoint.scan import Record
from tasks.errors import CkptopsError, unreadable

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

_DCP_MODULES = ("torch.distributed.checkpoint.", "megatron.core.dist_checkpointing.")
_EXPLICIT = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
_SHARD_KEY = re.compile(r"^(?P<family>.+)/shard_(?P<offset>[\d.]+)_(?P<shape>[\d.]+)$")


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


def load_dcp_metadata(path: Path) -> Metadata:
    """Unpickle a DCP ``.metadata`` file through the allowlist."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f, collector_off():
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckFailed(VerifyCheck.DCP_METADATA, path.name, "missing") from None
    except OSError as e:
        raise unreadable(path, e) from None
    except Exception as e:  # a garbled pickle can raise nearly anything
        raise CheckFailed(
            VerifyCheck.DCP_METADATA, path.name, f"unreadable ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckFailed(VerifyCheck.DCP_METADATA, path.name, "not a DCP Metadata object with storage data")
    return metadata


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
    try:
        with open(directory / record.file, "rb") as f:
            data = os.pread(f.fileno(), record.length, record.offset)
    except FileNotFoundError:
        raise CheckFailed(VerifyCheck.FILES, record.file, f"missing, it holds '{record.key}'") from None
    except OSError as e:
        raise unreadable(directory / record.file, e) from None
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
    elif (directory / "common.pt").exists():
        source, name = directory / "common.pt", "common.pt"
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


def load_object(directory: Path, index: DcpIndex, key: str):
    """One small sharded object (a data-parallel group's optimizer param groups), loaded safely;
    megatron stores the list of the object's shards' data."""
    record = index.records[(key, None)]
    loaded = weights_only_load(io.BytesIO(read_record(directory, record)), record.file)
    return loaded[0] if isinstance(loaded, list) and len(loaded) == 1 else loaded


def weights_only_load(source, name: str):
    import torch

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
