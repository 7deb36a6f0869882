"""Which ranks a hang waits on, from PyTorch's Flight Recorder: each rank's last collectives, one
dump per rank (``TORCH_FR_DUMP_TEMP_FILE`` prefix + the rank: NCCL's watchdog writes them on its
timeout; a gloo job writes ``torch._C._distributed_c10d._dump_fr_trace()`` itself).

The files are named as torch's own reader (``torch.distributed.flight_recorder``) expects, but
are not read with it: it unpickles whatever is there, and a dump is untrusted input. A dump is a
dict of plain values, so a pickle that names any Python class or function is refused unread;
JSON dumps (``_dump_nccl_trace_json``, torchcomms) are read as well.

A dump is read as any bytes ckptops did not write are (``tasks.storage.bounded``): a regular file
of at most MAX_DUMP_BYTES; a pickle scanned before it is unpickled, and refused past
MAX_DUMP_VALUES operations (a shared reference counts each time it is used: a memo-reference bomb
is refused unread); nested at most MAX_DUMP_DEPTH deep; times of creation within
EARLIEST_NS..LATEST_NS; process groups of at most MAX_WORLD ranks, each rank within the dump's
own world. The world is the caller's, else the size a majority of the dumps state (never one
rank's claim): a dump of another size, or a file whose rank is outside that world, is dropped.
Each dump dropped is one line naming the file and the limit; the rest are still read.

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
import math
import os
import pickle
import pickletools
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.errors import CkptopsError, Malformed, UsageError, unreadable
from tasks.storage.bounded import bounded_int, check_depth, load_json, read_bounded
from tasks.storage.local import TEMP_MARK

# torch's naming: a prefix, then the rank (``nccl_trace_rank_12``, ``fr_trace_rank_0``).
DUMP_NAME = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)$")
MAX_DUMP_BYTES = 64 << 20
# A dump of 2,000 entries (torch's usual buffer) with 30 stack frames each is about 700,000 pickle
# operations; torchtitan's 20,000 without frames about 800,000.
MAX_DUMP_VALUES = 5_000_000
MAX_DUMP_DEPTH = 16  # a dump nests 5 deep (entries, an entry, its sizes, a size)
MAX_WORLD = 1 << 20  # ranks: far past any job's, far below what a claim of millions would cost
EARLIEST_NS, LATEST_NS = 946_684_800 * 10**9, 4_102_444_800 * 10**9  # 2000-01-01 .. 2100-01-01
MAX_SEQUENCE = 2**63 - 1
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


def _parse(raw: bytes, path: Path) -> Any:
    """A dump's bytes as plain values: JSON, or a pickle scanned first (``_scan``) and then
    unpickled with no Python object allowed."""
    if raw.lstrip()[:1] == b"{":
        values = raw.count(b",") + raw.count(b"{") + raw.count(b"[")
        if values > MAX_DUMP_VALUES:
            raise Malformed(f"{path}: a JSON dump of over {MAX_DUMP_VALUES:,} values; refused unread")
        return load_json(raw, path, "Flight Recorder dump", MAX_DUMP_DEPTH)
    _scan(raw, path)
    try:
        data = _PlainValues(io.BytesIO(raw)).load()
    except _Refused as e:
        raise Malformed(f"{path}: not a Flight Recorder dump, refused unread: {e}") from None
    except Exception as e:  # the unpickler's own errors on bytes that are not a pickle
        raise Malformed(f"{path}: torn or not a Flight Recorder dump ({e or type(e).__name__})") from None
    check_depth(data, path, "Flight Recorder dump", MAX_DUMP_DEPTH)
    return data


def _widths() -> list:
    """For each pickle opcode, what follows it: a fixed number of bytes, a length of 1, 4 or 8
    bytes and that many bytes (negative), one line ("line") or two ("pair"); None: no opcode."""
    table: list = [None] * 256
    lengths = {
        pickletools.TAKEN_FROM_ARGUMENT1: -1,
        pickletools.TAKEN_FROM_ARGUMENT4: -4,
        pickletools.TAKEN_FROM_ARGUMENT4U: -4,
        pickletools.TAKEN_FROM_ARGUMENT8U: -8,
    }
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            width = 0
        elif arg.n >= 0:
            width = arg.n
        elif arg.n == pickletools.UP_TO_NEWLINE:
            width = "pair" if arg.name == "stringnl_noescape_pair" else "line"
        else:
            width = lengths[arg.n]
        table[ord(op.code)] = width
    return table


_WIDTHS = _widths()
_STOP = ord(pickletools.code2op["."].code)


def _scan(raw: bytes, path: Path) -> None:
    """Count a pickle's operations without making any object: each makes at most one value or
    reference, so a pickle of a few megabytes that would unpickle to gigabytes (a reference to one
    list, used millions of times) is refused here, at MAX_DUMP_VALUES."""
    at, count, end = 0, 0, len(raw)
    try:
        while at < end:
            code = raw[at]
            at, count = at + 1, count + 1
            if count > MAX_DUMP_VALUES:
                raise Malformed(
                    f"{path}: a pickle of over {MAX_DUMP_VALUES:,} values and references, more than a "
                    "Flight Recorder dump holds; refused unread"
                )
            width = _WIDTHS[code]
            if code == _STOP:
                return
            if width is None:
                break
            if width == "line":
                at = raw.index(b"\n", at) + 1
            elif width == "pair":
                at = raw.index(b"\n", raw.index(b"\n", at) + 1) + 1
            elif width >= 0:
                at += width
            else:
                at += -width + int.from_bytes(raw[at : at - width], "little")
    except ValueError:
        pass  # a line that never ends: torn, as the unpickler says
    # Torn or not a pickle: the unpickler names what is wrong.


def _ranks(text, path: Path, name: str) -> list[int] | None:
    """A group's ranks as the dump writes them (``"[0, 1]"``, or a list): at most MAX_WORLD, each
    within 0..MAX_WORLD-1; None where the dump names none."""
    what = f"process group {name[:40]!r}'s ranks"
    if isinstance(text, str):
        if len(text) > 12 * MAX_WORLD:
            raise Malformed(f"{path}: {what} is longer than {12 * MAX_WORLD:,} characters; refused")
        text = load_json(text, path, what, depth=1)
    if not isinstance(text, list) or not text:
        return None
    if len(text) > MAX_WORLD:
        raise Malformed(f"{path}: {what} are {len(text):,}, more than {MAX_WORLD:,}; refused")
    return [_int(r, path, what, 0, MAX_WORLD - 1) for r in text]


def _int(value, path: Path, key: str, low: int, high: int) -> int:
    """``bounded_int``, with an integer too long to print refused by its length first."""
    if isinstance(value, int) and value.bit_length() > 64:
        raise Malformed(
            f"{path}: {key} is an integer of {value.bit_length()} bits, outside {low}..{high:,}; refused"
        )
    return bounded_int(value, path, key, low, high)


def _check_version(data: dict, path: Path) -> None:
    version = data.get("version")
    major = str(version)[:20].split(".", 1)[0]
    if not isinstance(version, str) or not major.isdigit() or int(major) != KNOWN_MAJOR:
        shown = version[:20] if isinstance(version, str) else type(version).__name__
        raise Malformed(f"{path}: Flight Recorder dump version {shown!r}, not one this reader knows (2.x)")


def _newest(entries: list, path: Path) -> tuple[dict[str, Collective], int | None]:
    newest: dict[str, Collective] = {}
    latest = None
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise Malformed(f"{path}: entry {index} is not a record")
        created = entry.get("time_created_ns")
        if created is not None:
            created = _int(created, path, f"entry {index}'s time_created_ns", EARLIEST_NS, LATEST_NS)
            latest = created if latest is None else max(latest, created)
        group, seq = entry.get("process_group"), entry.get("collective_seq_id")
        if entry.get("is_p2p") or not isinstance(seq, int) or isinstance(seq, bool):
            continue  # point-to-point, or not a numbered collective
        if _int(seq, path, f"entry {index}'s collective_seq_id", -MAX_SEQUENCE, MAX_SEQUENCE) <= 0:
            continue
        if not (
            isinstance(group, list | tuple) and len(group) == 2 and all(isinstance(g, str) for g in group)
        ):
            raise Malformed(f"{path}: entry {index} has no process group (collective {seq})")
        name, desc = group[0][:200], group[1][:200]
        if name not in newest or seq >= newest[name].sequence:
            op = str(entry.get("profiling_name", "?"))[:200]
            newest[name] = Collective(name, desc, seq, op)
    return newest, latest


def read_dump(path: Path, rank: int) -> Dump:
    """One rank's dump; a CkptopsError naming the file and what is wrong if it cannot be used."""
    data = _parse(read_bounded(path, MAX_DUMP_BYTES, "a Flight Recorder dump", follow=False), path)
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise Malformed(f"{path}: not a Flight Recorder dump (no entries)")
    _check_version(data, path)
    config = data.get("pg_config") if isinstance(data.get("pg_config"), dict) else {}
    members = {}
    world = None
    for name, group in config.items():
        # gloo's configuration holds one unnamed entry, some group's, whichever: not used.
        ranks = _ranks(group.get("ranks"), path, str(name)) if isinstance(group, dict) and name else None
        if ranks is not None:
            members[str(name)[:200]] = ranks
            if group.get("desc") == "default_pg":
                world = ranks
    if world is not None:
        if sorted(world) != list(range(len(world))):
            raise Malformed(f"{path}: its default process group's ranks are not 0..{len(world) - 1}; refused")
        outside = next((r for ranks in members.values() for r in ranks if r >= len(world)), None)
        if outside is not None or rank >= len(world):
            raise Malformed(
                f"{path}: rank {rank if outside is None else outside} is outside the dump's own world "
                f"of {len(world)} ranks; refused"
            )
    newest, latest = _newest(data["entries"], path)
    return Dump(rank, str(path), world, members, newest, latest)


def read_dumps(
    directory: Path, world_size: int | None = None, since: float | None = None
) -> tuple[list[Dump], list[str], set[int], int | None]:
    """Every rank's dump in ``directory`` (the most common file prefix; files of another prefix
    are another job's), one line for each file that could not be used, the ranks that have a
    file at all, and the job's world size (``world_size``, else the dumps' majority, else None).
    ``since``: when the job started (epoch seconds); a dump written before it, or whose newest
    entry is older, is an earlier run's: left out, with one line for all of them."""
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
    limit = world_size or MAX_WORLD
    ranks = (
        f"the job's {world_size:,} ranks" if world_size else f"0..{MAX_WORLD - 1:,}, the ranks ckptops reads"
    )
    dumps, files, old = [], set(), []
    for rank, path in by_prefix[prefix]:
        if rank >= limit:
            problems.append(f"{path}: rank {_short(rank)} is outside {ranks}; not a dump of this job")
            continue
        if since is not None and _written(path) < since:
            old.append(path)
            continue
        try:
            dump = read_dump(path, rank)
        except CkptopsError as e:
            files.add(rank)
            problems.append(str(e))
            continue
        if since is not None and dump.newest_ns is not None and dump.newest_ns < since * 1e9:
            old.append(path)
            continue
        files.add(rank)
        dumps.append(dump)
    if old:
        problems.append(_older(directory, old, since))
    dumps, world = _same_job(dumps, problems, world_size)
    # A file of a rank outside the world agreed on (unreadable as well: it has its line) is no
    # rank of the job that left no usable dump.
    files = {r for r in files if world is None or r < world}
    return dumps, problems, files, world


def _written(path: Path) -> float:
    """A dump file's modification time; one that cannot be seen is read (and says why)."""
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return math.inf


def _older(directory: Path, old: list[Path], since: float) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(since))
    what = "1 dump" if len(old) == 1 else f"{len(old):,} dumps"
    return (
        f"{directory}: {what} older than the failed job's start ({when}), an earlier run's: ignored "
        f"(first: {old[0].name})"
    )


def _short(rank: int) -> str:
    text = str(rank)
    return text if len(text) <= 20 else f"{text[:8]}...{text[-4:]} ({len(text)} digits)"


def _same_job(
    dumps: list[Dump], problems: list[str], world_size: int | None
) -> tuple[list[Dump], int | None]:
    """Drop dumps of another job or run: another world size than the caller's or than a majority
    of the dumps state, a rank outside it, or entries an hour older than the others' newest."""
    world = world_size
    if world is None:
        sizes = Counter(len(d.world) for d in dumps if d.world)
        common = sizes.most_common(1)
        if common and common[0][1] * 2 > len(dumps):
            world = common[0][0]
        elif common:
            problems.append(f"the dumps agree on no world size ({_sizes(sizes)} of {len(dumps)} dumps)")
    times = [d.newest_ns for d in dumps if d.newest_ns is not None]
    middle = statistics.median(times) if times else None
    kept = []
    for d in dumps:
        outside = world is not None and (
            d.rank >= world or any(r >= world for ranks in d.members.values() for r in ranks)
        )
        if world is not None and d.world and len(d.world) != world:
            problems.append(f"{d.path}: another job's dump (a world of {len(d.world)} ranks, not {world})")
        elif outside:
            problems.append(
                f"{d.path}: names ranks outside the world of {world} ranks; not a dump of this job"
            )
        elif (
            middle is not None and d.newest_ns is not None and (middle - d.newest_ns) / 1e9 > FOREIGN_SECONDS
        ):
            hours = (middle - d.newest_ns) / 3.6e12
            problems.append(
                f"{d.path}: another run's dump (its newest entry {hours:.1f} h before the others')"
            )
        else:
            kept.append(d)
    return kept, world


def _sizes(sizes: Counter) -> str:
    return ", ".join(f"{size:,} ranks in {n}" for size, n in sizes.most_common(3))


def attribute(
    dumps: list[Dump], problems: list[str], files: set[int], world_size: int | None = None
) -> Attribution:
    """The stuck collective and the ranks that never entered it (see the module's docstring).
    ``files``: the ranks that left a dump file, usable or not; ``world_size``: how many ranks the
    job has, where known (``read_dumps`` says)."""
    by_rank = {d.rank: d for d in dumps}
    expected = world_size
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
    return attribute(*read_dumps(directory, world_size))
