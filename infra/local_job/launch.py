"""Launch the local training job (Megatron-LM's own loop: pretrain.py) with torchrun, with a
timeout and clean-up of every child.

Megatron's failure modes on CPU hang rather than crash, and a dead rank leaves megatron's
writer Manager orphaned: every process the job started is killed when it ends, however it ended
(``tasks.cluster.process``).
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path
from string import Template

from tasks.cluster import process

PRETRAIN = Path(__file__).with_name("pretrain.py")
JOB_SCRIPT = Path(__file__).with_name("job.sh.in")
REPO = Path(__file__).resolve().parent.parent.parent


def torchrun_command(nproc: int, args: list[str], entry: Path = PRETRAIN) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(entry),
        *args,
    ]


def job_env() -> dict[str, str]:
    # One thread per rank: two ranks on two cores, no oversubscription. Huge pages for torch's
    # large CPU tensors: on this project's VMs first-touch page faults ran at about 1.2 GB/s and
    # dominated loading (optimizer state is allocated, then filled); with them a 2.6 GB load
    # went from 7.9 s to 5.8 s.
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "THP_MEM_ALLOC_ENABLE": "1",
    }


def start_local_job(
    save_dir: Path,
    *,
    nproc: int = 2,
    train_iters: int = 8,
    save_interval: int = 4,
    log: Path | None = None,
    extra: list[str] = (),
    entry: Path = PRETRAIN,
) -> tuple[subprocess.Popen, Path]:
    """Start training into ``save_dir`` in the background (Megatron-LM's loop, or another
    ``entry`` taking the same arguments); pair with ``wait_local_job``."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    log = Path(log or save_dir.parent / f"{save_dir.name}-train.log")
    args = [
        "--save",
        str(save_dir),
        "--train-iters",
        str(train_iters),
        "--save-interval",
        str(save_interval),
        *extra,
    ]
    return process.start(torchrun_command(nproc, args, entry), log, job_env()), log


def wait_local_job(job: subprocess.Popen, log: Path, timeout_seconds: float) -> None:
    """Wait for the job; kill everything it started; raise if it failed or timed out."""
    process.wait(job, log, timeout_seconds, "local training job")


def write_job_script(
    path: Path,
    save_dir: Path,
    records: Path,
    *,
    job_name: str = "local-tiny",
    nodes: int = 2,
    port: int = 29500,
    train_iters: int = 8,
    save_interval: int = 4,
    notify_url: str = "",
    extra: list[str] = (),
) -> Path:
    """The job as its own batch script (sbatch on the local Slurm cluster, or bash with torchrun
    here): what a team hands to ckptops as ``recovery.script``."""
    quote = lambda value: shlex.quote(str(value))  # noqa: E731
    text = Template(JOB_SCRIPT.read_text()).substitute(
        JOB_NAME=job_name,
        NODES=nodes,
        REPO=quote(REPO),
        SAVE=quote(save_dir),
        RECORDS=quote(records),
        PORT=port,
        PYTHON=quote(sys.executable),
        TRAIN_ITERS=train_iters,
        SAVE_INTERVAL=save_interval,
        NOTIFY_URL=notify_url,
        EXTRA=" ".join(quote(a) for a in extra),
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def run_local_job(save_dir: Path, *, timeout_seconds: float = 600, **kwargs) -> Path:
    """Train and save into ``save_dir``; return the log path. Raises CkptopsError on failure."""
    job, log = start_local_job(save_dir, **kwargs)
    wait_local_job(job, log, timeout_seconds)
    return log
