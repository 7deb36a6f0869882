"""The per-file hash in a manifest: XXH3-128, taken over fixed segments so that several nodes can
hash one file between them and still agree with one host that read it all.

- A file no longer than one segment: the XXH3-128 of its bytes, as manifests have always had it.
- A longer file: the XXH3-128 of its segments' 16-byte XXH3-128 digests, in order (segment ``k``
  is bytes ``[k * S, (k + 1) * S)``).

XXH3 cannot resume from the middle of a stream, so without segments an 80 GB file would have to be
read by one reader from start to end, and it would finish last. The segment size is recorded in the
manifest (``hash_segment_bytes``); None there means a whole-file hash (manifests written before
segments, which stay comparable for every file no longer than the other side's segment).
"""

import xxhash

DEFAULT_SEGMENT_BYTES = 1 << 30


class FileHash:
    """Hashes a run of a file's bytes starting at ``position`` (a segment boundary), collecting
    one digest per segment; ``segment_bytes`` None hashes it all as one segment."""

    def __init__(self, segment_bytes: int | None, position: int = 0):
        if segment_bytes is not None and position % segment_bytes:
            raise ValueError(f"position {position} is not on a {segment_bytes}-byte segment boundary")
        self.segment_bytes = segment_bytes
        self.position = position
        self.digests: list[bytes] = []
        self._current = None

    def update(self, data) -> None:
        view = memoryview(data)
        while view:
            if self._current is None:
                self._current = xxhash.xxh3_128()
            room = (
                len(view)
                if self.segment_bytes is None
                else self.segment_bytes - self.position % self.segment_bytes
            )
            part = view[:room]
            self._current.update(part)
            self.position += len(part)
            view = view[len(part) :]
            if self.segment_bytes is not None and self.position % self.segment_bytes == 0:
                self.digests.append(self._current.digest())
                self._current = None

    def finish(self) -> list[bytes]:
        """The segment digests (an empty run still has one: the digest of no bytes)."""
        if self._current is not None or not self.digests:
            self.digests.append((self._current or xxhash.xxh3_128()).digest())
            self._current = None
        return self.digests


def combine(digests: list[bytes]) -> str:
    """A file's hash from all its segment digests, in order."""
    if len(digests) == 1:
        return digests[0].hex()
    return xxhash.xxh3_128(b"".join(digests)).hexdigest()


def comparable(recorded: int | None, used: int | None, sizes) -> bool:
    """Whether hashes taken with segment size ``recorded`` can be compared with hashes taken with
    ``used`` for files of these sizes: the same size, or every file within one segment of both."""
    if recorded == used:
        return True
    smaller = min(s for s in (recorded, used) if s is not None)
    return all(size <= smaller for size in sizes)
