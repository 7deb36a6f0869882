"""The per-file hash in a manifest, taken over fixed segments so that several nodes can hash one
file between them and still agree with one host that read it all.

- A file no longer than one segment: the digest of its bytes (XXH3-128, BLAKE3 or SHA-256).
- A longer file: the digest, with the same algorithm, of its segments' digests in order (segment
  ``k`` is bytes ``[k * S, (k + 1) * S)``).

XXH3 cannot resume from the middle of a stream, so without segments an 80 GB file would have to be
read by one reader from start to end, and it would finish last. The algorithm and the segment size
are recorded in the manifest (``hash_algorithm``, ``hash_segment_bytes``); a segment size of None
there means a whole-file hash (manifests written before segments, which stay comparable for every
file no longer than the other side's segment).

XXH3-128 finds accidents (a flipped bit, a torn write), not forgery: whoever can write a shard
can write its XXH3 too. BLAKE3 and SHA-256 are cryptographic: a signed manifest of them vouches
for the bytes (``tasks.checkpoint.signing``). BLAKE3 of a file within one segment is what
``b3sum`` prints, SHA-256 what ``sha256sum`` and Megatron's ``integrity.json`` hold.
"""

import hashlib
from dataclasses import dataclass

import blake3
import xxhash

DEFAULT_SEGMENT_BYTES = 1 << 30
XXH3 = "xxh3-128"
BLAKE3 = "blake3"
SHA256 = "sha256"
# The hashes, by the name manifests record; the profile's verify.digest names them shorter.
ALGORITHMS = {XXH3: xxhash.xxh3_128, BLAKE3: blake3.blake3, SHA256: hashlib.sha256}
PROFILE_NAMES = {"xxh3": XXH3, "blake3": BLAKE3, "sha256": SHA256}
CRYPTOGRAPHIC = frozenset({BLAKE3, SHA256})


@dataclass(frozen=True)
class Hashing:
    """How a manifest's file hashes are taken: the algorithm and the segment size."""

    algorithm: str = XXH3
    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown hash algorithm {self.algorithm!r} (known: {', '.join(ALGORITHMS)})")

    @property
    def digest_bytes(self) -> int:
        return ALGORITHMS[self.algorithm]().digest_size

    @property
    def cryptographic(self) -> bool:
        return self.algorithm in CRYPTOGRAPHIC

    def new(self):
        return ALGORITHMS[self.algorithm]()


class FileHash:
    """Hashes a run of a file's bytes starting at ``position`` (a segment boundary), collecting
    one digest per segment; a segment size of None hashes it all as one segment."""

    def __init__(self, hashing: Hashing, position: int = 0):
        segment_bytes = hashing.segment_bytes
        if segment_bytes is not None and position % segment_bytes:
            raise ValueError(f"position {position} is not on a {segment_bytes}-byte segment boundary")
        self.hashing = hashing
        self.segment_bytes = segment_bytes
        self.position = position
        self.digests: list[bytes] = []
        self._current = None

    def update(self, data) -> None:
        view = memoryview(data)
        while view:
            if self._current is None:
                self._current = self.hashing.new()
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
            self.digests.append((self._current or self.hashing.new()).digest())
            self._current = None
        return self.digests


def combine(digests: list[bytes], algorithm: str = XXH3) -> str:
    """A file's hash from all its segment digests, in order."""
    if len(digests) == 1:
        return digests[0].hex()
    whole = ALGORITHMS[algorithm]()
    whole.update(b"".join(digests))
    return whole.hexdigest()


def comparable(recorded: int | None, used: int | None, sizes) -> bool:
    """Whether hashes taken with segment size ``recorded`` can be compared with hashes taken with
    ``used`` for files of these sizes: the same size, or every file within one segment of both."""
    if recorded == used:
        return True
    smaller = min(s for s in (recorded, used) if s is not None)
    return all(size <= smaller for size in sizes)
