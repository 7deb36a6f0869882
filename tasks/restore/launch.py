"""Where a drill runs its loader (``tasks.restore.loader``): torchrun on this host, or a Slurm
drill allocation submitted with ``sbatch --wait`` and started on every node with ``srun``.

Either way the loader writes a ``LoadReport``, and a rank that fails writes its own first error
beside it; the load's whole output goes to a log the caller keeps.
"""

import importlib.resources
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

from tasks.cluster import process
from tasks.errors import CkptopsError, UsageError
from tasks.restore.report import LoadReport, first_error, read_report
from tasks.storage.local import atomic_write, open_for_writing, write_all

# The drill allocation's batch script: package data, found the same way installed or in a checkout.
SBATCH_TEMPLATE = importlib.resources.files("tasks.restore") / "restore_drill.sbatch"


@dataclass(frozen=True)
class LoaderShape:
    tensor_parallel: int
    pipeline_parallel: int
    world_size: int

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)


def drill_layout(drill, checkpoint_layout: dict) -> LoaderShape:
    """TP and PP as the profile sets them (default: the checkpoint's); the world is the Slurm
    allocation's tasks, or TP x PP x ``drill.layout.data_parallel`` locally."""
    tp = drill.layout.tensor_parallel or checkpoint_layout.get("tensor_parallel") or 1
    pp = drill.layout.pipeline_parallel or checkpoint_layout.get("pipeline_parallel") or 1
    if drill.launcher == "slurm":
        world = drill.slurm.nodes * drill.slurm.ntasks_per_node
        if world % (tp * pp):
            raise UsageError(
                f"drill.slurm: {drill.slurm.nodes} nodes x {drill.slurm.ntasks_per_node} tasks = {world} "
                f"ranks, not a multiple of TP {tp} x PP {pp}"
            )
    else:
        world = tp * pp * drill.layout.data_parallel
    return LoaderShape(tp, pp, world)


def loader_args(drill, checkpoint: Path, report: Path, layout: LoaderShape) -> list[str]:
    args = [
        "--checkpoint",
        str(checkpoint),
        "--report",
        str(report),
        "--tensor-sample",
        str(drill.tensor_sample),
        "--tensor-parallel",
        str(layout.tensor_parallel),
        "--pipeline-parallel",
        str(layout.pipeline_parallel),
    ]
    if drill.model_provider:
        args += ["--model-provider", drill.model_provider]
    return args


def torchrun(layout: LoaderShape, arguments: list[str]) -> list[str]:
    """The loader under torchrun on this host, one process per rank of the layout."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={layout.world_size}",
        "-m",
        "tasks.restore.loader",
        *arguments,
    ]


def loader_env() -> dict[str, str]:
    # One thread per rank on CPU (ranks share the cores); huge pages for torch's large CPU
    # tensors: first-touch page faults dominate a CPU load on this project's VMs.
    return {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONWARNINGS": "ignore",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "THP_MEM_ALLOC_ENABLE": "1",
    }


def render_sbatch(slurm, layout: LoaderShape, arguments: list[str], output: Path, job_name: str) -> str:
    """The batch script a Slurm drill submits (every value shell-quoted; nothing is eval'd)."""
    python = slurm.python or sys.executable
    command = shlex.join([python, "-m", "tasks.restore.loader", *arguments])
    directives = [
        f"--job-name={job_name}",
        f"--nodes={slurm.nodes}",
        f"--ntasks-per-node={slurm.ntasks_per_node}",
        f"--output={output}",
        *allocation_options(slurm),
    ]
    return Template(SBATCH_TEMPLATE.read_text()).substitute(
        DIRECTIVES="\n".join(f"#SBATCH {shlex.quote(d)}" for d in directives),
        PRELUDE=slurm.prelude,
        MASTER_PORT=slurm.master_port,
        SRUN_ARGS=shlex.join(slurm.srun_args),
        COMMAND=command,
    )


_JOB_ID = re.compile(r"^(\d+)(?:;(\S+))?$", re.MULTILINE)


def submitted_job(log: Path) -> tuple[str, list[str]] | None:
    """``sbatch --parsable`` prints ``jobid[;cluster]`` on a line of its own (warnings may come
    first): the job id and the ``-M`` option that names its cluster."""
    try:
        found = _JOB_ID.search(Path(log).read_text(errors="replace"))
    except OSError:
        return None
    return (found[1], ["-M", found[2]] if found[2] else []) if found else None


def cancel(log: Path, hard: bool = False) -> str:
    """Cancel the submitted job, and say how that went (the timeout stays the drill's error).
    ``hard``: SIGKILL to every step and the batch script first, for a run that must not save on
    its way out (Megatron-LM's ``--exit-signal-handler`` saves on SIGTERM)."""
    job = submitted_job(log)
    if job is None:
        return f"no Slurm job id in {log}: cancel it by hand"
    job_id, cluster = job
    if hard:
        process.capture(["scancel", *cluster, "--signal=KILL", "--full", job_id], 30)
    done = process.capture(["scancel", *cluster, job_id], 30)
    if done.exit_code != 0:
        why = "no answer in 30s" if done.timed_out else done.stderr.strip() or done.exit_code
        return f"scancel {job_id} failed ({why}): cancel it by hand"
    return f"Slurm job {job_id} cancelled"


class LoadFailed(CkptopsError):
    """The load itself failed; the message is its own first error, with where its log is."""


def run_loader(profile, checkpoint: Path, layout: LoaderShape, report: Path, log: Path) -> LoadReport:
    """Load ``checkpoint`` for real on ``layout``; return the loader's report, or raise with the
    load's own first error (a usage error when the profile, not the checkpoint, is at fault)."""
    drill = profile.drill
    arguments = loader_args(drill, checkpoint, report, layout)
    try:
        if drill.launcher == "slurm":
            _run_slurm(profile, layout, arguments, report, log)
        else:
            process.run(
                torchrun(layout, arguments), log, drill.load_timeout_seconds, loader_env(), "the drill's load"
            )
    except process.Failed as e:
        own = first_error(report)
        if own is None:
            raise LoadFailed(f"the load exited {e.code} without saying why; its log: {log}") from None
        error = UsageError if own.get("usage") else LoadFailed
        raise error(f"{own['error']} (rank {own['rank']}; log: {log})") from None
    return read_report(report)


def _run_slurm(profile, layout: LoaderShape, arguments: list[str], report: Path, log: Path) -> None:
    slurm = profile.drill.slurm
    script = report.with_suffix(".sbatch")
    output = log.with_suffix(".job.log")
    atomic_write(
        script, render_sbatch(slurm, layout, arguments, output, f"ckptops-drill-{profile.job.name}").encode()
    )
    try:
        sbatch_wait([str(script)], log, profile.drill.load_timeout_seconds, "the drill's Slurm job")
    finally:
        _append(log, output)


def sbatch_wait(
    arguments: list[str], log: Path, timeout_seconds: float, what: str, env: dict | None = None
) -> None:
    """``sbatch --parsable --wait`` with ``arguments``, to the job's end (``process.Failed`` when
    it failed); its lines in ``log``. A job past ``timeout_seconds`` is cancelled, never left
    running once the drill's scratch is going away."""
    try:
        process.run(["sbatch", "--parsable", "--wait", *arguments], log, timeout_seconds, env, what)
    except FileNotFoundError:
        raise UsageError("sbatch: not found on this host (drill.launcher is slurm)") from None
    except process.TimedOut as e:
        raise process.TimedOut(f"{e}; {cancel(log)}") from None


def allocation_options(slurm) -> list[str]:
    """The drill allocation's partition, account, time, GPUs and exclusivity as sbatch options."""
    options = [f"--time={slurm.time_limit}"]
    options += [f"--partition={slurm.partition}"] * bool(slurm.partition)
    options += [f"--gpus-per-node={slurm.gpus_per_node}"] * bool(slurm.gpus_per_node)
    options += [f"--account={slurm.account}"] * bool(slurm.account)
    return options + ["--exclusive"] * slurm.exclusive


def _append(log: Path, output: Path) -> None:
    """The job's own output (the loader's) after sbatch's lines, in the one log the drill keeps."""
    try:
        text = output.read_text(errors="replace")
    except OSError:
        return
    fd = open_for_writing(log, append=True)
    try:
        write_all(fd, f"\n# the Slurm job's output\n{text}".encode(), log)
    finally:
        os.close(fd)
    output.unlink()
