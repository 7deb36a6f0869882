"""Which ranks a hang waits on, from PyTorch's Flight Recorder: each rank's last collectives, one
dump per rank (``TORCH_FR_DUMP_TEMP_FILE`` prefix + the rank: NCCL's watchdog writes them on its
timeout; a gloo job writes ``torch._C._distributed_c10d._dump_fr_trace()`` itself).

The files are named as torch's own reader (``torch.distributed.flight_recorder``) expects, but
are not read with it: it unpickles whatever is there, and a dump is untrusted input. A dump is a
dict of plain values, so a pickle that names any Python class or function is refused unread;
JSON dumps (``_dump_nccl_trace_json``, torchcomms) are read as well.

The match: every process group's collectives are numbered alike on all its ranks
(``collective_seq_id``). In each group, the ranks whose newest collective has the group's highest
number entered it and wait there; the ranks behind never entered it. A rank that is behind in
one group but waits in another is a victim too; the suspects are the ranks that are behind
somewhere and wait nowhere (stuck outside any collective: a hung kernel, a dead process, a data
loader). On gloo no completion is recorded (every entry stays ``scheduled``), so only the
numbers are used, on NCCL as well. Point-to-point operations (pipeline sends and receives) are
not matched: a hang between two pipeline stages shows through the collectives the others wait in.
"""

import io
import json
import math
import os
import pickle
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tasks.errors import UsageError, unreadable
from tasks.storage.local import TEMP_MARK, open_regular

# torch's naming: a prefix, then the rank (``nccl_trace_rank_12``, ``fr_trace_rank_0``).
DUMP_NAME = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)$")
MAX_DUMP_BYTES = 256 << 20
KNOWN_MAJOR = 2  # torch's dump versions 2.x (2.10 in torch 2.14); 1.x had no process groups
# A dump whose newest entry is this much older than the others' is from another run of the job.
FOREIGN_SECONDS = 3600.0


class _Refused(pickle.UnpicklingError):
    pass


class _PlainValues(pickle.Unpickler):
    """A dump holds dicts, lists, tuples, strings and numbers: anything else is refused unread."""

    def find_class(self, module, name):
        raise _Refused(f"it names the Python object {module}.{name}")


@dataclass(frozen=True)
class Collective:
    """A rank's newest collective in one process group."""

    group: str
    desc: str
    sequence: int
    op: str


@dataclass
class Dump:
    rank: int
    path: str
    world: list[int] | None  # the default group's ranks, where the dump says
    members: dict[str, list[int]]  # process group -> its ranks, where the dump says
    newest: dict[str, Collective]  # process group -> this rank's newest collective in it
    newest_ns: int | None


@dataclass
class Attribution:
    """What the dumps show: the collective the job is stuck in, who never entered it, and how
    much could be read."""

    read: int
    expected: int | None
    problems: list[str] = field(default_factory=list)  # one line a dump that could not be used
    files: set[int] = field(default_factory=set)  # the ranks with a dump file, usable or not
    suspect_ranks: list[int] = field(default_factory=list)
    stuck: dict | None = None  # the stuck collective (group, desc, op, sequence, size, present, missing)
    no_dump: list[int] = field(default_factory=list)  # expected ranks that left no dump
    reason: str = ""

    def to_dict(self) -> dict:
        return {
            "read": self.read,
            "expected": self.expected,
            "problems": list(self.problems),
            "suspect_ranks": list(self.suspect_ranks),
            "stuck_collective": self.stuck,
            "files": sorted(self.files),
            "no_dump": list(self.no_dump),
            "reason": self.reason,
        }


def _parse(raw: bytes) -> dict:
    if raw.lstrip()[:1] == b"{":
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ValueError(f"torn or not a Flight Recorder dump (JSON: {e})") from None
    try:
        return _PlainValues(io.BytesIO(raw)).load()
    except _Refused as e:
        raise ValueError(f"not a Flight Recorder dump, refused unread: {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, MemoryError) as e:
        raise ValueError(f"torn or not a Flight Recorder dump ({e or type(e).__name__})") from None


def _ranks(text) -> list[int] | None:
    """A group's ranks as the dump writes them (``"[0, 1]"``, or a list)."""
    try:
        ranks = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return None
    if (
        isinstance(ranks, list)
        and ranks
        and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)
    ):
        return ranks
    return None


def _check_version(data: dict) -> None:
    version = data.get("version")
    major = str(version).split(".", 1)[0]
    if not isinstance(version, str) or not major.isdigit() or int(major) != KNOWN_MAJOR:
        raise ValueError(f"Flight Recorder dump version {version!r}, not one this reader knows (2.x)")


def _newest(entries) -> tuple[dict[str, Collective], int | None]:
    newest: dict[str, Collective] = {}
    latest = None
    for entry in entries:
        if not isinstance(entry, dict):
            raise ValueError("an entry that is not a record")
        created = entry.get("time_created_ns")
        if isinstance(created, int):
            latest = created if latest is None else max(latest, created)
        group, seq = entry.get("process_group"), entry.get("collective_seq_id")
        if entry.get("is_p2p") or not isinstance(seq, int) or seq <= 0:
            continue  # point-to-point, or not a numbered collective
        if not (isinstance(group, list | tuple) and len(group) == 2):
            raise ValueError(f"an entry without its process group (collective {seq})")
        name, desc = str(group[0]), str(group[1])
        if name not in newest or seq >= newest[name].sequence:
            op = str(entry.get("profiling_name", "?"))
            newest[name] = Collective(name, desc, seq, op)
    return newest, latest


def read_dump(path: Path, rank: int) -> Dump:
    """One rank's dump; ValueError with the reason if it cannot be used."""
    try:
        with open_regular(path, follow=False) as f:
            raw = f.read(MAX_DUMP_BYTES + 1)
    except UsageError as e:
        raise ValueError(str(e).split(": ", 1)[-1]) from None
    except OSError as e:
        raise unreadable(path, e) from None
    if len(raw) > MAX_DUMP_BYTES:
        raise ValueError(f"over {MAX_DUMP_BYTES >> 20} MiB, not a Flight Recorder dump")
    data = _parse(raw)
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError("not a Flight Recorder dump (no entries)")
    _check_version(data)
    config = data.get("pg_config") if isinstance(data.get("pg_config"), dict) else {}
    members = {}
    world = None
    for name, group in config.items():
        # gloo's configuration holds one unnamed entry, some group's, whichever: not used.
        ranks = _ranks(group.get("ranks")) if isinstance(group, dict) and name else None
        if ranks is not None:
            members[str(name)] = ranks
            if group.get("desc") == "default_pg":
                world = ranks
    newest, latest = _newest(data["entries"])
    return Dump(rank, str(path), world, members, newest, latest)


def read_dumps(directory: Path) -> tuple[list[Dump], list[str], set[int]]:
    """Every rank's dump in ``directory`` (the most common file prefix; files of another prefix
    are another job's), one line for each file that could not be used, and the ranks that have a
    file at all."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"{directory}: no such directory of Flight Recorder dumps")
    by_prefix: dict[str, list[tuple[int, Path]]] = {}
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as e:
        raise unreadable(directory, e) from None
    for entry in entries:
        match = DUMP_NAME.match(entry.name)
        # A dump being written (atomic_write's temporary, as the local job writes them) is not one yet.
        if match and not entry.name.startswith(".") and TEMP_MARK not in entry.name:
            by_prefix.setdefault(match["prefix"], []).append((int(match["rank"]), Path(entry.path)))
    if not by_prefix:
        raise UsageError(f"{directory}: no Flight Recorder dumps (files named PREFIX<rank>)")
    prefix = max(by_prefix, key=lambda p: (len(by_prefix[p]), p))
    problems = [
        f"{path}: another job's dump (prefix {other!r}, not {prefix!r})"
        for other, files in by_prefix.items()
        if other != prefix
        for _, path in files
    ]
    dumps = []
    for rank, path in by_prefix[prefix]:
        try:
            dumps.append(read_dump(path, rank))
        except ValueError as e:
            problems.append(f"{path}: {e}")
    return *_same_job(dumps, problems), {rank for rank, _ in by_prefix[prefix]}


def _same_job(dumps: list[Dump], problems: list[str]) -> tuple[list[Dump], list[str]]:
    """Drop dumps of another job or run: another world size than most, or entries an hour older
    than the others' newest."""
    sizes = [len(d.world) for d in dumps if d.world]
    size = statistics.mode(sizes) if sizes else None
    times = [d.newest_ns for d in dumps if d.newest_ns is not None]
    middle = statistics.median(times) if times else None
    kept = []
    for d in dumps:
        if size is not None and d.world and len(d.world) != size:
            problems.append(f"{d.path}: another job's dump (a world of {len(d.world)} ranks, not {size})")
        elif (
            middle is not None and d.newest_ns is not None and (middle - d.newest_ns) / 1e9 > FOREIGN_SECONDS
        ):
            hours = (middle - d.newest_ns) / 3.6e12
            problems.append(
                f"{d.path}: another run's dump (its newest entry {hours:.1f} h before the others')"
            )
        else:
            kept.append(d)
    return kept, problems


def attribute(
    dumps: list[Dump], problems: list[str], files: set[int], world_size: int | None = None
) -> Attribution:
    """The stuck collective and the ranks that never entered it (see the module's docstring).
    ``files``: the ranks that left a dump file, usable or not; ``world_size``: how many ranks the
    job has, where the caller knows (else the dumps say, where they do)."""
    by_rank = {d.rank: d for d in dumps}
    worlds = [d.world for d in dumps if d.world]
    expected = world_size or (len(worlds[0]) if worlds else None)
    result = Attribution(len(by_rank), expected, list(problems), set(files))
    if expected:
        result.no_dump = [r for r in range(expected) if r not in files]
    pending = _pending(by_rank)
    waiting = {r for p in pending for r in p["present"]}
    culprits = sorted({r for p in pending for r in p["missing"] if r not in waiting})
    if pending:
        stuck = max(
            pending,
            key=lambda p: (bool(set(p["missing"]) & set(culprits)), len(p["present"]), -p["sequence"]),
        )
        result.stuck = stuck
        result.suspect_ranks = culprits or sorted(stuck["missing"])
        result.reason = (
            f"{stuck['op']} #{stuck['sequence']} of process group {stuck['group']} ({stuck['desc']}, "
            f"{stuck['size']} ranks): {_who(stuck['present'])} entered it, {_who(stuck['missing'])} never did"
        )
    elif result.no_dump and by_rank:
        result.suspect_ranks = list(result.no_dump)
        result.reason = (
            f"every dump read agrees on each group's newest collective; {_who(result.no_dump)} "
            "left no dump (gone before the others timed out)"
        )
    else:
        result.reason = "no rank is behind in any process group's collectives"
    of = f" of {expected}" if expected else ""
    result.reason += f"; dumps of {result.read}{of} ranks read"
    if problems:
        result.reason += f", {len(problems)} unusable"
    return result


def _pending(by_rank: dict[int, Dump]) -> list[dict]:
    """Each process group whose newest collective some of its ranks never entered."""
    # A group's ranks: those whose dumps hold its collectives, and those its configuration names
    # (NCCL's dumps name every group's ranks; gloo's only the default group's, under another name).
    groups: dict[str, tuple[str, set[int]]] = {}
    for rank, d in by_rank.items():
        for name, collective in d.newest.items():
            groups.setdefault(name, (collective.desc, set()))[1].add(rank)
    for d in by_rank.values():
        for name, ranks in d.members.items():
            if name in groups:
                groups[name][1].update(r for r in ranks if r in by_rank)
    found = []
    for name, (desc, ranks) in sorted(groups.items()):
        seqs = {r: by_rank[r].newest[name].sequence if name in by_rank[r].newest else 0 for r in ranks}
        top = max(seqs.values())
        missing = sorted(r for r, s in seqs.items() if s < top)
        if not missing:
            continue
        present = sorted(r for r, s in seqs.items() if s == top)
        op = by_rank[present[0]].newest[name].op
        found.append(
            {
                "group": name,
                "desc": desc,
                "op": op,
                "sequence": top,
                "size": len(ranks),
                "present": present,
                "missing": missing,
            }
        )
    return found


def _who(ranks: list[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {_list(ranks)}"


def _list(ranks: list[int]) -> str:
    """Ranks as ranges: 0-3, 5."""
    if not ranks:
        return "none"
    parts, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [math.inf], strict=True):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def flight_recorder(directory: Path, world_size: int | None = None) -> Attribution:
    """Read the dumps in ``directory`` and attribute the hang."""
    return attribute(*read_dumps(directory), world_size)
