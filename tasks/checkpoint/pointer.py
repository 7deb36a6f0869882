"""The promotion pointer, ``<save>/latest_verified_iteration.txt``: the one checkpoint every
recovery resumes from. Its only writer is promotion, under the job lock.

Same format as Megatron-LM's tracker (one integer and a newline) so scripts can pass it straight
to ``--ckpt-step``. Unlike Megatron's tracker it is replaced atomically, so a crash at any moment
leaves the old value or the new one, never an empty or partial file.

Beside it, ``latest_verified_iteration.hold`` records an operator's rollback: after ``promote
--iteration N`` to an older checkpoint, the newer ones it rolled back from must not be promoted
again by the next scheduled run; only checkpoints verified after the rollback may pass N.
"""

import json
import re
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from tasks.checkpoint.layout import HISTORY, POINTER, iter_dir_name
from tasks.checkpoint.manifest import UNCHECKED, Manifest, now_iso, valid_for_this_save
from tasks.checkpoint.signing import Trust
from tasks.errors import CkptopsError, Malformed
from tasks.storage.local import (
    append_jsonl,
    atomic_write,
    last_jsonl,
    own_folder,
    read_json_state,
    read_jsonl,
    read_state,
    remove_file,
    remove_stale_temps,
)

HOLD = "latest_verified_iteration.hold"
PROMOTIONS = "promotions.jsonl"


# What write_pointer writes (and Megatron's tracker holds): ASCII digits and a newline. Python's
# int() would also take "+12", "1_2" or non-ASCII digits, none of which any writer of ours wrote.
_POINTER_TEXT = re.compile(rb"\s*([0-9]+)\s*")


def read_pointer(save_dir: Path) -> int | None:
    path = Path(save_dir) / POINTER
    data = read_state(path)
    if data is None:
        return None
    found = _POINTER_TEXT.fullmatch(data)
    if found is None:
        text = data[:40].decode("utf-8", "replace")
        raise Malformed(f"{path}: garbled pointer {text!r} (expected an iteration number)")
    return int(found[1])


@dataclass(frozen=True)
class Promoted:
    iteration: int
    directory: Path
    manifest: Manifest


def promoted(save_dir: Path, trust: Trust = UNCHECKED) -> Promoted:
    """The checkpoint the pointer names, re-checked as promotion checks it: its manifest says
    valid for the save now on disk (read as ``trust`` asks). What every reader of the promoted
    checkpoint starts from."""
    iteration = read_pointer(save_dir)
    if iteration is None:
        raise CkptopsError(f"{save_dir}: nothing promoted")
    directory = Path(save_dir) / iter_dir_name(iteration)
    manifest = valid_for_this_save(directory, iteration, trust)
    if manifest is None:
        raise CkptopsError(f"{directory.name}: promoted but its manifest does not say valid for this save")
    return Promoted(iteration, directory, manifest)


def write_pointer(save_dir: Path, iteration: int) -> None:
    """Replace the pointer (the caller holds the job lock, so stale temps are ours to clear)."""
    path = Path(save_dir) / POINTER
    remove_stale_temps(path)
    atomic_write(path, f"{iteration}\n".encode())


def record_promotion(
    save_dir: Path, iteration: int | None, previous: int | None, why: str, gap: bool = False
) -> None:
    """Append a change of the pointer to ``.ckptops-history/promotions.jsonl``: which checkpoint
    was the one to resume from at any moment (post-resume validation asks "at the resume").
    ``gap``: the change happened at an unknown time since the entry before (found unlogged)."""
    entry = {"time": time.time(), "at": now_iso(), "iteration": iteration, "previous": previous, "why": why}
    if gap:
        entry["gap"] = True
    append_jsonl(own_folder(save_dir, HISTORY) / PROMOTIONS, entry)


@dataclass
class _Change:
    time: float
    iteration: int | None
    previous: int | None
    gap: bool


def _iteration_or_none(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _is_change(entry: dict) -> bool:
    """Whether a line of the promotion log is a change of the pointer as ``record_promotion``
    writes it: a time, and iterations that are numbers (or none)."""
    stamp = entry.get("time")
    return (
        isinstance(stamp, int | float)
        and not isinstance(stamp, bool)
        and "iteration" in entry
        and _iteration_or_none(entry["iteration"])
        and _iteration_or_none(entry.get("previous"))
    )


def _changes(save_dir: Path) -> list[_Change]:
    """The pointer's changes, oldest first; a line that is not one (bytes ckptops did not write)
    is skipped with one warning naming the file and line, and never stops a promotion."""
    return [
        _Change(float(e["time"]), e["iteration"], e.get("previous"), bool(e.get("gap")))
        for e in read_jsonl(Path(save_dir) / HISTORY / PROMOTIONS, _is_change)
    ]


def last_logged(save_dir: Path) -> tuple[bool, int | None]:
    """(any entry, the pointer value the log ends with)."""
    entry = last_jsonl(Path(save_dir) / HISTORY / PROMOTIONS, _is_change)
    return (True, entry["iteration"]) if entry is not None else (False, None)


def history_begins(save_dir: Path) -> float | None:
    """When the promotion log's first change was made (epoch seconds); None without a log."""
    changes = _changes(save_dir)
    return changes[0].time if changes else None


def pointer_during(save_dir: Path, start: float, end: float) -> set[int | None] | None:
    """Every value the pointer may have had between ``start`` and ``end`` (epoch seconds), from
    the promotion log; None without a log. A span that ends in a gap entry may have held either
    value. Entries are taken in file order (clocks of different writers may disagree a little;
    the caller's window absorbs that)."""
    changes = _changes(save_dir)
    if not changes:
        return None
    values = {changes[0].previous} if start < changes[0].time else set()
    for i, change in enumerate(changes):
        following = changes[i + 1] if i + 1 < len(changes) else None
        until = following.time if following else float("inf")
        if change.time <= end and until > start:
            values.add(change.iteration)
            if following is not None and following.gap:
                values.add(following.iteration)
    return values


def clear_pointer(save_dir: Path) -> None:
    """Remove the pointer: no checkpoint is known good. A recovery must then stop and ask,
    rather than resume from something that failed verification."""
    remove_file(Path(save_dir) / POINTER)


@dataclass(frozen=True)
class Hold:
    iteration: int
    since: datetime


def read_hold(save_dir: Path) -> Hold | None:
    path = Path(save_dir) / HOLD
    data = read_json_state(path, "the rollback hold")
    if data is None:
        return None
    try:
        iteration, since = data["iteration"], datetime.fromisoformat(data["since"])
        if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
            raise ValueError(f"iteration {iteration!r} is not an iteration number")
        if since.tzinfo is None:
            raise ValueError(f"since {data['since']!r} has no timezone")
    except (ValueError, KeyError, TypeError) as e:
        raise Malformed(
            f"{path}: garbled rollback hold ({e}); remove it to resume automatic promotion"
        ) from None
    return Hold(iteration, since)


def write_hold(save_dir: Path, iteration: int) -> None:
    path = Path(save_dir) / HOLD
    remove_stale_temps(path)
    atomic_write(path, json.dumps({"iteration": iteration, "since": now_iso()}).encode())


def clear_hold(save_dir: Path) -> None:
    remove_file(Path(save_dir) / HOLD)
