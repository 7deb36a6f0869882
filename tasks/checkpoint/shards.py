"""One checkpoint's reading split into shards for the Slurm engine, and the shards' results merged
back into the per-file scans the verifier judges.

The plan, the results and the progress notes are small JSON files in a work directory that every
node sees; a shard task needs nothing else (no Prefect, no database).

How the bytes are split:
- files in writer order (``__<rank>_<n>.distcp`` by rank), so that a shard holds the files of a
  run of neighbouring ranks;
- a file longer than one hash segment is cut at segment boundaries (``tasks.storage.digest``), so
  an 80 GB file becomes many units instead of one straggler; each span checks the CRCs of the
  records that begin in it (``scan.owned_records``). A file whose SHA-256 is wanted
  (``integrity.json``) stays whole: SHA-256 cannot be taken in parts;
- the units are cut into ``count`` contiguous runs of about equal bytes, each unit going to the run
  its middle byte falls in.

Which task reads which shard is rotated by one node (``rotation``): when the verify allocation is
the job's own, in rank order, node ``i`` wrote shard ``i``'s files and its page cache could serve
them back from memory, hiding what never reached the storage; it reads shard ``i - 1``'s instead.
"""

import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pydantic

from tasks.checkpoint.scan import FileScan, Record, owned_records
from tasks.checkpoint.values import RecordValues
from tasks.errors import Malformed
from tasks.storage.digest import XXH3, Hashing, combine
from tasks.storage.local import atomic_write

PLAN = "plan.json"
_DIGITS = re.compile(r"(\d+)")


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of file ``name``, which had ``size`` bytes when planned."""

    name: str
    start: int
    end: int
    size: int
    sha256: bool = False
    records: int = 0  # how many records this span owns (``assign_records``)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class Shard:
    index: int
    pieces: list[Piece]

    @property
    def bytes(self) -> int:
        return sum(p.length for p in self.pieces)

    @property
    def files(self) -> list[str]:
        return sorted({p.name for p in self.pieces})


@dataclass
class ShardPlan:
    directory: str
    segment_bytes: int | None
    rotation: int
    shards: list[Shard]
    max_read_mbps: float | None = None
    drop_cache: bool = True
    algorithm: str = XXH3

    @property
    def hashing(self) -> Hashing:
        return Hashing(self.algorithm, self.segment_bytes)

    def shard_for_task(self, task: int) -> int:
        return (task - self.rotation) % len(self.shards)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def read(cls, path: Path) -> "ShardPlan":
        data = json.loads(Path(path).read_text())
        data["shards"] = [Shard(s["index"], [Piece(**p) for p in s["pieces"]]) for s in data["shards"]]
        return cls(**data)


def writer_order(name: str) -> tuple:
    """Natural order: ``__2_0.distcp`` before ``__10_0.distcp``."""
    return tuple(int(part) if part.isdigit() else part for part in _DIGITS.split(name))


def plan_shards(
    sizes: dict[str, int], count: int, segment_bytes: int | None, whole: set[str] = frozenset()
) -> list[Shard]:
    """Split files of these sizes into at most ``count`` shards of about equal bytes (fewer when
    there are fewer units than that); ``whole`` names files that must not be split."""
    units = []
    for name in sorted(sizes, key=writer_order):
        size = sizes[name]
        if segment_bytes is None or name in whole or size <= segment_bytes:
            units.append(Piece(name, 0, size, size, name in whole))
        else:
            units += [
                Piece(name, start, min(size, start + segment_bytes), size)
                for start in range(0, size, segment_bytes)
            ]
    total = sum(u.length for u in units)
    count = max(1, min(count, len(units)))
    runs: list[list[Piece]] = [[] for _ in range(count)]
    done = 0
    for i, unit in enumerate(units):
        middle = done + unit.length / 2
        run = min(count - 1, int(middle * count / total)) if total else i % count
        done += unit.length
        previous = runs[run][-1] if runs[run] else None
        if previous is not None and previous.name == unit.name and previous.end == unit.start:
            runs[run][-1] = Piece(unit.name, previous.start, unit.end, unit.size, unit.sha256)
        else:
            runs[run].append(unit)
    return [Shard(i, pieces) for i, pieces in enumerate(p for p in runs if p)]


def assign_records(
    shards: list[Shard], records: dict[str, list[Record]]
) -> tuple[list[Shard], dict[int, list[Record]]]:
    """Each shard's records (those its spans own), in one pass over them all; and the shards with
    each piece's count of them: what its result must report."""
    counted, owned = [], {}
    for shard in shards:
        pieces, owned[shard.index] = [], []
        for p in shard.pieces:
            mine = owned_records(records.get(p.name, []), p.start, p.end, p.end == p.size)
            pieces.append(replace(p, records=len(mine)))
            owned[shard.index] += mine
        counted.append(Shard(shard.index, pieces))
    return counted, owned


def expected_segments(piece: Piece, segment_bytes: int | None) -> int:
    if segment_bytes is None or piece.length == 0:
        return 1
    return math.ceil(piece.length / segment_bytes)


# Results: one file per shard and attempt, written once, atomically, by the task that read it.


def result_path(work: Path, shard: int, attempt: int) -> Path:
    return Path(work) / "results" / f"shard-{shard}-attempt-{attempt}.json"


def progress_path(work: Path, shard: int, attempt: int) -> Path:
    return Path(work) / "progress" / f"shard-{shard}-attempt-{attempt}.json"


@dataclass
class PieceResult:
    name: str
    start: int
    end: int
    size: int  # the file's size as the task found it
    segments: list[str]
    sha256: str | None = None
    records: int = 0
    failures: list[str] = field(default_factory=list)
    changed: bool = False
    stat: list[int] | None = None  # the file's inode, size and mtime_ns as the task found it
    values: list[RecordValues] = field(default_factory=list)  # the tensor records it read

    @classmethod
    def of(cls, scan: FileScan) -> "PieceResult":
        return cls(
            scan.name,
            scan.start,
            scan.end,
            scan.size,
            [d.hex() for d in scan.segments],
            scan.sha256,
            scan.records,
            list(scan.failures),
            scan.changed,
            scan.stat,
            list(scan.values),
        )


@dataclass
class ShardResult:
    shard: int
    attempt: int
    node: str
    seconds: float
    bytes: int
    pieces: list[PieceResult] = field(default_factory=list)
    error: str | None = None  # the shard could not be read on this node: no verdict from it

    def write(self, work: Path) -> None:
        path = result_path(work, self.shard, self.attempt)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(asdict(self), sort_keys=True).encode())


def read_result(path: Path, shard: Shard, hashing: Hashing) -> ShardResult:
    """A task's result, checked against what its shard was planned to read: anything missing,
    unparsable or not matching the plan is ``Malformed`` (the shard failed; never a pass)."""
    try:
        result = _RESULT.validate_json(Path(path).read_bytes(), strict=True)
    except FileNotFoundError:
        raise Malformed(f"{path}: no result written") from None
    except OSError as e:
        raise Malformed(f"{path}: unreadable result ({e.strerror or e})") from None
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise Malformed(f"{path}: malformed result ({where}: {first['msg']})") from None
    if result.shard != shard.index:
        raise Malformed(f"{path}: result of shard {result.shard}, not {shard.index}")
    if result.error is not None:
        return result
    planned = [(p.name, p.start, p.end) for p in shard.pieces]
    got = [(p.name, p.start, p.end) for p in result.pieces]
    if sorted(got) != sorted(planned):
        raise Malformed(f"{path}: pieces {got} differ from the plan's {planned}")
    by_key = {(p.name, p.start): p for p in shard.pieces}
    for piece in result.pieces:
        if piece.changed:
            continue  # a file that changed under the task is never judged: no digests needed
        planned = by_key[(piece.name, piece.start)]
        if piece.records != planned.records:
            raise Malformed(
                f"{path}: {piece.name} at {piece.start}: "
                f"{piece.records} records checked, {planned.records} planned"
            )
        if planned.sha256 and not (
            isinstance(piece.sha256, str) and len(piece.sha256) == 64 and _is_hex(piece.sha256)
        ):
            raise Malformed(f"{path}: {piece.name}: no SHA-256, which integrity.json needs")
        want = expected_segments(planned, hashing.segment_bytes)
        if len(piece.segments) != want or not all(
            isinstance(s, str) and len(s) == 2 * hashing.digest_bytes and _is_hex(s) for s in piece.segments
        ):
            raise Malformed(
                f"{path}: {piece.name} at {piece.start}: "
                f"{len(piece.segments)} segment digests, {want} expected"
            )
    return result


# Read back strictly: a field of the wrong type or one the task never writes is a damaged result.
PieceResult.__pydantic_config__ = ShardResult.__pydantic_config__ = pydantic.ConfigDict(extra="forbid")
_RESULT = pydantic.TypeAdapter(ShardResult)


def _is_hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return True


def merge(
    shards: list[Shard],
    results: dict[int, ShardResult],
    stats: dict[str, list[int] | None],
    algorithm: str = XXH3,
) -> dict[str, FileScan]:
    """Per-file scans from every shard's result (each shard must have one): the spans of a file
    joined in order, their segment digests combined into the file's hash. A file counts as
    changed unless every span was read from the very file planned (``stats``: inode, size and
    mtime when planned): spans of two versions would join into a hash of neither."""
    spans: dict[str, list[tuple[Piece, PieceResult]]] = {}
    for shard in shards:
        found = {(p.name, p.start): p for p in results[shard.index].pieces}
        for piece in shard.pieces:
            spans.setdefault(piece.name, []).append((piece, found[(piece.name, piece.start)]))
    scans = {}
    for name, parts in spans.items():
        parts.sort(key=lambda pair: pair[0].start)
        planned = parts[0][0].size
        scan = FileScan(name, size=planned, start=0, end=planned)
        for piece, result in parts:
            scan.records += result.records
            scan.failures += result.failures
            scan.values += result.values
            # Another size or version than planned: a writer at work since, never judged.
            scan.changed |= result.changed or result.size != planned or result.stat != stats.get(name)
            scan.segments += [bytes.fromhex(s) for s in result.segments]
            scan.sha256 = result.sha256 if piece.sha256 else scan.sha256
        scan.hash = combine(scan.segments, algorithm)
        scans[name] = scan
    return scans


def write_plan(work: Path, plan: ShardPlan, owned: dict[int, list[Record]]) -> None:
    """The plan, and beside it each shard's records (``assign_records``, from the coordinator's
    reading of ``.metadata``): a task reads only its own, and never unpickles anything."""
    folder = Path(work) / "records"
    folder.mkdir(parents=True, exist_ok=True)
    for shard in plan.shards:
        records = [asdict(r) for r in owned[shard.index]]
        atomic_write(folder / f"shard-{shard.index}.json", json.dumps(records).encode())
    atomic_write(Path(work) / PLAN, plan.to_json().encode())


def read_records(work: Path, shard: int) -> dict[str, list[Record]]:
    """A shard's records by file (``write_plan``)."""
    found: dict[str, list[Record]] = {}
    for item in json.loads((Path(work) / "records" / f"shard-{shard}.json").read_bytes()):
        record = Record(**item)
        found.setdefault(record.file, []).append(record)
    return found
