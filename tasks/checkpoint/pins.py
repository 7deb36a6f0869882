"""Pins: checkpoints that retention must not delete, whatever their age.

One file per pin in ``<save>/.ckptops-pins/``, named ``iter_NNNNNNN@<holder>``: an operator's
pin ("before-lr-change") or a reader's lease (a restore drill reading the checkpoint). A file per
pin means two holders never rewrite one shared file, and removing a pin is one unlink.
"""

import json
import re
import socket
from contextlib import contextmanager
from pathlib import Path

from tasks.checkpoint.layout import PINS, iter_dir_name, parse_iter_dir
from tasks.checkpoint.manifest import now_iso
from tasks.errors import CkptopsError, UsageError, unreadable
from tasks.storage.local import TEMP_MARK, atomic_write

_HOLDER = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


def _pin_path(save_dir: Path, iteration: int, holder: str) -> Path:
    if not _HOLDER.match(holder):
        raise UsageError(f"pin holder {holder!r}: use letters, digits, '.', '_' or '-'")
    return Path(save_dir) / PINS / f"{iter_dir_name(iteration)}@{holder}"


def pin(save_dir: Path, iteration: int, holder: str, reason: str) -> Path:
    if not Path(save_dir).is_dir():
        raise UsageError(f"{save_dir}: no such save directory")
    path = _pin_path(save_dir, iteration, holder)
    try:
        path.parent.mkdir(exist_ok=True)
        atomic_write(
            path, json.dumps({"reason": reason, "since": now_iso(), "host": socket.gethostname()}).encode()
        )
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


def pins(save_dir: Path) -> dict[int, list[str]]:
    """Pinned iterations and their holders."""
    found: dict[int, list[str]] = {}
    folder = Path(save_dir) / PINS
    if folder.is_dir():
        for path in folder.iterdir():
            name, _, holder = path.name.partition("@")
            iteration = parse_iter_dir(name)
            if iteration is not None and holder and TEMP_MARK not in holder:
                found.setdefault(iteration, []).append(holder)
    return found


@contextmanager
def pinned(save_dir: Path, iteration: int, holder: str, reason: str):
    """Hold a pin for the duration of a read (a lease).

    Pins are taken without the job lock, so retention may have removed the checkpoint just
    before the pin landed; retention re-reads pins before each delete, so once the directory is
    seen after pinning, it stays.
    """
    pin(save_dir, iteration, holder, reason)
    try:
        if not (Path(save_dir) / iter_dir_name(iteration)).is_dir():
            raise CkptopsError(f"{iter_dir_name(iteration)}: gone from {save_dir} (deleted by retention?)")
        yield
    finally:
        unpin(save_dir, iteration, holder)
