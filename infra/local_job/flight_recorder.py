"""PyTorch's Flight Recorder for the local job on gloo: each rank's last collectives, dumped where
``TORCH_FR_DUMP_TEMP_FILE`` says (the prefix; the rank is appended), as NCCL's watchdog dumps them
on a GPU. Recording is on when ``TORCH_FR_BUFFER_SIZE`` is set before the process groups exist;
gloo has no watchdog that dumps, so a rank dumps itself: when training raises (its collective
timed out, or a peer closed the connection) and when it is told to stop (torchrun's SIGTERM to a
rank that is still hanging). Nothing happens on a GPU or without those variables."""

import os
import signal
from pathlib import Path

import torch

from tasks.storage.local import atomic_write

PREFIX, BUFFER = "TORCH_FR_DUMP_TEMP_FILE", "TORCH_FR_BUFFER_SIZE"


def _on() -> bool:
    return bool(os.environ.get(PREFIX)) and bool(os.environ.get(BUFFER)) and not torch.cuda.is_available()


def dump() -> None:
    """Write this rank's trace (an exclusive temporary file renamed into place: a reader never sees
    half, and a link planted at the name is replaced, never followed)."""
    if not _on() or not torch.distributed.is_initialized():
        return
    path = Path(f"{os.environ[PREFIX]}{torch.distributed.get_rank()}")
    atomic_write(path, torch._C._distributed_c10d._dump_fr_trace())


def _on_sigterm(signum, frame) -> None:
    dump()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def start() -> None:
    if _on():
        signal.signal(signal.SIGTERM, _on_sigterm)
