"""Pins: checkpoints that retention must not delete, whatever their age.

One file per pin in ``<save>/.ckptops-pins/``, named ``iter_NNNNNNN@<holder>``: an operator's
pin ("before-lr-change") or a reader's lease (a restore drill or an archive copy reading the
checkpoint). A file per pin means two holders never rewrite one shared file, and removing a pin
is one unlink.

An operator's pin stays until it is removed. A lease names its process (host, pid, start time):
it expires when that process is gone (a drill killed with SIGKILL never unpins), or, for a
process on another host, after ``LEASE_MAX_AGE_HOURS``; an expired lease protects nothing and
retention removes it. Without this a crashed reader would keep a 7 TB checkpoint forever.
"""

import json
import re
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from tasks.checkpoint.layout import PINS, iter_dir_name, parse_iter_dir
from tasks.checkpoint.manifest import now_iso
from tasks.cluster.process import gone, identity
from tasks.errors import CkptopsError, UsageError, unreadable
from tasks.storage.local import TEMP_MARK, atomic_write, open_regular, own_folder, warn_once

_HOLDER = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
# Longer than any drill or archive copy of a 7 TB checkpoint runs (their own timeouts are hours).
LEASE_MAX_AGE_HOURS = 48
# More than any pin ckptops writes holds (a reason and a lease); the rest of a larger file is not read.
_PIN_LIMIT = 64 << 10


@dataclass(frozen=True)
class Pin:
    iteration: int
    holder: str
    reason: str
    since: str
    lease: dict | None  # the reading process (identity), or None for an operator's pin

    def expired(self, now: float | None = None) -> str | None:
        """Why this lease no longer protects its checkpoint, or None (an operator's pin never expires)."""
        if self.lease is None:
            return None
        why = gone(self.lease)
        if why:
            return f"lease expired: {why}"
        try:
            age = (now or time.time()) - datetime.fromisoformat(self.since).timestamp()
        except ValueError:
            return "lease expired: no readable start time"
        if age > LEASE_MAX_AGE_HOURS * 3600:
            return f"lease expired: older than {LEASE_MAX_AGE_HOURS} h"
        return None


def _pin_path(save_dir: Path, iteration: int, holder: str) -> Path:
    if not _HOLDER.match(holder):
        raise UsageError(f"pin holder {holder!r}: use letters, digits, '.', '_' or '-'")
    return Path(save_dir) / PINS / f"{iter_dir_name(iteration)}@{holder}"


def pin(save_dir: Path, iteration: int, holder: str, reason: str, lease: bool = False) -> Path:
    """Pin a checkpoint; ``lease``: held by this process, expiring when it is gone."""
    if not Path(save_dir).is_dir():
        raise UsageError(f"{save_dir}: no such save directory")
    path = _pin_path(save_dir, iteration, holder)
    record = {"reason": reason, "since": now_iso(), "host": socket.gethostname()}
    if lease:
        record["lease"] = identity()
    try:
        atomic_write(own_folder(save_dir, PINS) / path.name, json.dumps(record).encode())
    except OSError as e:
        raise unreadable(path, e) from None
    return path


def unpin(save_dir: Path, iteration: int, holder: str) -> bool:
    path = _pin_path(save_dir, iteration, holder)
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def all_pins(save_dir: Path) -> list[Pin]:
    """Every pin file, active or expired. One that is not a pin ckptops wrote (a link, a FIFO,
    bad UTF-8, not JSON) is an operator's pin, kept, with one warning naming it: a pin errs on
    the side of keeping the checkpoint, and never blocks the reader."""
    found = []
    folder = Path(save_dir) / PINS
    if not folder.is_dir():
        return found
    for path in sorted(folder.iterdir()):
        name, _, holder = path.name.partition("@")
        iteration = parse_iter_dir(name)
        if iteration is None or not holder or TEMP_MARK in holder:
            continue
        try:
            with open_regular(path, follow=False) as f:
                record = json.loads(f.read(_PIN_LIMIT))
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (CkptopsError, OSError, ValueError) as e:
            warn_once(f"{path}: not a pin ckptops wrote ({e}); kept as an operator's pin")
            record = {}
        lease = record.get("lease") if isinstance(record.get("lease"), dict) else None
        found.append(
            Pin(iteration, holder, str(record.get("reason", "")), str(record.get("since", "")), lease)
        )
    return found


def pins(save_dir: Path) -> dict[int, list[str]]:
    """Pinned iterations and their holders, expired leases left out."""
    found: dict[int, list[str]] = {}
    for p in all_pins(save_dir):
        if p.expired() is None:
            found.setdefault(p.iteration, []).append(p.holder)
    return found


def expired_leases(save_dir: Path) -> list[tuple[Pin, str]]:
    return [(p, why) for p in all_pins(save_dir) if (why := p.expired()) is not None]


def remove_expired_leases(save_dir: Path) -> list[str]:
    """Remove leases whose process is gone (the caller holds the job lock); what was removed."""
    removed = []
    for p, why in expired_leases(save_dir):
        if unpin(save_dir, p.iteration, p.holder):
            removed.append(f"{iter_dir_name(p.iteration)}@{p.holder} ({why})")
    return removed


@contextmanager
def pinned(save_dir: Path, iteration: int, holder: str, reason: str):
    """Hold a lease for the duration of a read.

    Pins are taken without the job lock, so retention may have removed the checkpoint just
    before the pin landed; retention re-reads pins before each delete, so once the directory is
    seen after pinning, it stays.
    """
    pin(save_dir, iteration, holder, reason, lease=True)
    try:
        if not (Path(save_dir) / iter_dir_name(iteration)).is_dir():
            raise CkptopsError(f"{iter_dir_name(iteration)}: gone from {save_dir} (deleted by retention?)")
        yield
    finally:
        unpin(save_dir, iteration, holder)
