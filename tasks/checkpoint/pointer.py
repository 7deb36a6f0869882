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
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from tasks.checkpoint.layout import POINTER
from tasks.checkpoint.manifest import now_iso
from tasks.errors import CkptopsError, unreadable
from tasks.storage.local import atomic_write, remove_file, remove_stale_temps

HOLD = "latest_verified_iteration.hold"


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
