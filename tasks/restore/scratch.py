"""A drill's scratch directory: made with its owner named inside, removed when the drill ends,
and, when a drill was killed before it could remove its own (SIGKILL, a lost node), removed by
the next drill once its owner is known to be gone.

The scratch may be a shared file system: the owner is host, pid and start time
(``tasks.cluster.process.identity``); another host's leftovers go only after
``SCRATCH_MAX_AGE_HOURS``, a drill's own timeout being far shorter.
"""

import json
import shutil
import time
from pathlib import Path

from tasks.cluster.process import gone, identity

OWNER = ".ckptops-owner.json"
PREFIX = "drill-"
SCRATCH_MAX_AGE_HOURS = 48


def make_scratch(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / OWNER).write_text(json.dumps(identity()))
    return path


def stale_scratch(scratch_dir: Path, now: float | None = None) -> list[tuple[Path, str]]:
    """Leftover drill scratch directories whose drill is gone, and why each is known to be."""
    found = []
    root = Path(scratch_dir)
    if not root.is_dir():
        return found
    for path in sorted(root.glob(f"{PREFIX}*")):
        if not path.is_dir() or path.is_symlink():
            continue
        try:
            owner = json.loads((path / OWNER).read_text())
        except (OSError, ValueError):
            owner = {}
        why = gone(owner) if isinstance(owner, dict) else None
        if why is None:
            age = (now or time.time()) - path.stat().st_mtime
            if age > SCRATCH_MAX_AGE_HOURS * 3600:
                why = f"untouched for {age / 3600:.0f} h"
        if why:
            found.append((path, why))
    return found


def clear_stale_scratch(scratch_dir: Path) -> list[str]:
    """Remove what ``stale_scratch`` finds; what was removed."""
    removed = []
    for path, why in stale_scratch(scratch_dir):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(f"{path} ({why})")
    return removed
