"""The promotion pointer, ``<save>/latest_verified_iteration.txt``: the one checkpoint every
recovery resumes from. Its only writer is promotion, under the job lock.

Same format as Megatron-LM's tracker (one integer and a newline) so scripts can pass it straight
to ``--ckpt-step``. Unlike Megatron's tracker it is replaced atomically, so a crash at any moment
leaves the old value or the new one, never an empty or partial file.
"""

from pathlib import Path

from tasks.checkpoint.layout import POINTER
from tasks.errors import CkptopsError
from tasks.storage.local import atomic_write, remove_stale_temps


def read_pointer(save_dir: Path) -> int | None:
    path = Path(save_dir) / POINTER
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise CkptopsError(f"{path}: garbled pointer {text[:40]!r} (expected an iteration number)") from None


def write_pointer(save_dir: Path, iteration: int) -> None:
    """Replace the pointer (the caller holds the job lock, so stale temps are ours to clear)."""
    path = Path(save_dir) / POINTER
    remove_stale_temps(path)
    atomic_write(path, f"{iteration}\n".encode())
