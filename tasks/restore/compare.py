"""Compare what a rank loaded with the bytes stored in the checkpoint, read without megatron.

A rank holds pieces of global tensors (``ShardedTensor``: a key, a global offset and a local
shape, or a flat range of that box). The checkpoint stores the same global tensors cut the way
the saving job cut them; after resharding (another TP or PP on the drill) the two cuts differ.
So the stored region is assembled from every stored chunk that overlaps the rank's box, each
chunk read with ckptops' own record reader and ``torch.load(weights_only=True)``, and compared
bit for bit.
"""

import io
from collections.abc import Iterable

import torch

from tasks.checkpoint.dcp import DcpIndex, read_record


class _Chunks:
    """Stored chunks, each read once however many boxes it overlaps."""

    def __init__(self, directory, index: DcpIndex):
        self.directory, self.index, self.cache = directory, index, {}

    def read(self, key: str, offsets: tuple[int, ...]) -> torch.Tensor:
        if (key, offsets) not in self.cache:
            record = self.index.records[(key, offsets)]
            self.cache[(key, offsets)] = torch.load(
                io.BytesIO(read_record(self.directory, record)), weights_only=True, map_location="cpu"
            )
        return self.cache[(key, offsets)]


def stored_region(
    chunks: _Chunks, key: str, offset: tuple[int, ...], shape: tuple[int, ...]
) -> torch.Tensor | None:
    """The stored values of ``key`` in the box ``[offset, offset + shape)``; None if the checkpoint
    does not hold all of it."""
    item = chunks.index.tensors.get(key)
    if item is None or len(item.size) != len(shape):
        return None
    region = torch.empty(shape, dtype=item.properties.dtype)
    covered = 0
    for chunk in item.chunks:
        lo = [max(o, c) for o, c in zip(offset, chunk.offsets)]
        hi = [min(o + s, c + cs) for o, s, c, cs in zip(offset, shape, chunk.offsets, chunk.sizes)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        data = chunks.read(key, tuple(chunk.offsets)).reshape(tuple(chunk.sizes))
        source = tuple(slice(low - c, h - c) for low, h, c in zip(lo, hi, chunk.offsets))
        target = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offset))
        region[target] = data[source]
        covered += int(torch.tensor([h - low for low, h in zip(lo, hi)]).prod())
    return region if covered == region.numel() else None


def _box(sharded) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The global box a ShardedTensor covers: its offset and local shape, with the axes megatron
    prepends (the layer index of stacked layers) as length-1 axes."""
    prepended = len(sharded.global_shape) - len(sharded.local_shape)
    return tuple(sharded.global_offset), (1,) * prepended + tuple(sharded.local_shape)


def sample(sharded_tensors: Iterable, k: int) -> list:
    """``k`` sharded tensors spread evenly over the sorted keys (the same pick on every run)."""
    ordered = sorted(sharded_tensors, key=lambda t: (t.key, tuple(t.global_offset)))
    step = max(1, len(ordered) // max(1, k))
    return ordered[::step][:k]


def compare(directory, index: DcpIndex, picked: list) -> tuple[list[str], list[str]]:
    """(compared, mismatches) for the picked ShardedTensors, labelled ``key@offset``."""
    chunks = _Chunks(directory, index)
    compared, mismatches = [], []
    for sharded in picked:
        offset, shape = _box(sharded)
        label = f"{sharded.key}@{list(offset)}"
        stored = stored_region(chunks, sharded.key, offset, shape)
        loaded = sharded.data.detach().to("cpu")
        compared.append(label)
        if stored is None:
            mismatches.append(f"{label} (not all of it is in the checkpoint)")
            continue
        flat = getattr(sharded, "flattened_range", None)
        expected = stored.flatten()[flat] if flat is not None else stored.reshape(loaded.shape)
        if loaded.dtype != expected.dtype or not torch.equal(loaded.reshape(expected.shape), expected):
            mismatches.append(label)
    return compared, mismatches
