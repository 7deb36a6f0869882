"""The job's batch script checked before a recovery relaunches it: refused when a relaunch with
it could start from the wrong state, or when it is not a regular file."""

from pathlib import Path

from tasks.errors import CkptopsError, unreadable
from tasks.storage.local import open_regular

# Megatron-LM switches a relaunch must (not) carry: without the first a missing checkpoint
# silently starts from random weights; the second loads what was never persisted.
REQUIRED_FLAG = "--exit-on-missing-checkpoint"
FORBIDDEN_FLAG = "--non-persistent-ckpt-type"


class RelaunchRefused(CkptopsError):
    """The relaunch was not submitted: its script is unsafe, or the scheduler refused it."""


def check_script(script: Path) -> str:
    """The job's batch script, refused when a relaunch with it could start from the wrong state
    (or when it is not a regular file: a FIFO would block the reader, and bash, forever)."""
    try:
        with open_regular(script) as f:
            text = f.read().decode(errors="replace")
    except OSError as e:
        raise unreadable(script, e) from None
    if FORBIDDEN_FLAG in text:
        raise RelaunchRefused(
            f"{script}: uses {FORBIDDEN_FLAG}: a relaunch could load a checkpoint that was never persisted"
        )
    if REQUIRED_FLAG not in text:
        raise RelaunchRefused(
            f"{script}: lacks {REQUIRED_FLAG}: without a checkpoint a relaunch starts from random weights"
        )
    return text
