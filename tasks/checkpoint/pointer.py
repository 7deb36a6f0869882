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
import os
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from tasks.checkpoint.layout import HISTORY, POINTER
from tasks.checkpoint.manifest import now_iso
from tasks.errors import CkptopsError, unreadable
from tasks.storage.local import atomic_write, remove_file, remove_stale_temps

HOLD = "latest_verified_iteration.hold"
PROMOTIONS = "promotions.jsonl"


def read_pointer(save_dir: Path) -> int | None:
    path = Path(save_dir) / POINTER
    try:
        text = path.read_bytes().decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    except OSError as e:
        raise unreadable(path, e) from None
    try:
        return int(text.strip())
    except ValueError:
        raise CkptopsError(f"{path}: garbled pointer {text[:40]!r} (expected an iteration number)") from None


def write_pointer(save_dir: Path, iteration: int) -> None:
    """Replace the pointer (the caller holds the job lock, so stale temps are ours to clear)."""
    path = Path(save_dir) / POINTER
    remove_stale_temps(path)
    atomic_write(path, f"{iteration}\n".encode())


def record_promotion(save_dir: Path, iteration: int | None, why: str) -> None:
    """Append the pointer's new value to ``.ckptops-history/promotions.jsonl``: which checkpoint
    was the one to resume from at any moment (post-resume validation asks "at the resume").
    One ``write`` on an O_APPEND file: lines never interleave; a torn last line is skipped."""
    path = Path(save_dir) / HISTORY / PROMOTIONS
    path.parent.mkdir(exist_ok=True)
    line = json.dumps({"time": time.time(), "at": now_iso(), "iteration": iteration, "why": why}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def pointer_at(save_dir: Path, when: float) -> tuple[bool, int | None]:
    """(known, iteration): the pointer's value at ``when`` (epoch seconds) from the promotion
    log; not known when the log does not reach back that far."""
    try:
        lines = (Path(save_dir) / HISTORY / PROMOTIONS).read_text().splitlines()
    except FileNotFoundError:
        return False, None
    except OSError as e:
        raise unreadable(Path(save_dir) / HISTORY / PROMOTIONS, e) from None
    known, iteration = False, None
    for line in lines:
        try:
            entry = json.loads(line)
            stamp, value = float(entry["time"]), entry["iteration"]
        except (ValueError, KeyError, TypeError):
            continue
        if stamp > when:
            break
        known, iteration = True, value
    return known, iteration


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
    try:
        data = json.loads(path.read_text())
        return Hold(int(data["iteration"]), datetime.fromisoformat(data["since"]))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise unreadable(path, e) from None
    except (ValueError, KeyError, TypeError) as e:
        raise CkptopsError(f"{path}: garbled rollback hold ({e}); remove it to resume automatic promotion") from None


def write_hold(save_dir: Path, iteration: int) -> None:
    path = Path(save_dir) / HOLD
    remove_stale_temps(path)
    atomic_write(path, json.dumps({"iteration": iteration, "since": now_iso()}).encode())


def clear_hold(save_dir: Path) -> None:
    remove_file(Path(save_dir) / HOLD)
