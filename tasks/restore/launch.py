"""Where a drill loads the restored checkpoint: the local job on this machine, or a Slurm drill
allocation on the cluster. Either way the loader writes a JSON report of what it loaded."""

import json
import re
import shlex
import subprocess
from pathlib import Path
from string import Template

from infra.local_job.launch import TimedOut, job_env, run_reaped, torchrun_command
from tasks.errors import CkptopsError

SBATCH_TEMPLATE = Path(__file__).resolve().parents[2] / "infra" / "slurm" / "restore_drill.sbatch"


def render_sbatch(slurm, load_dir: Path, iteration: int, report: Path, job_name: str) -> str:
    """The batch script a production drill submits (values shell-quoted; nothing is eval'd)."""
    return Template(SBATCH_TEMPLATE.read_text()).substitute(
        JOB_NAME=shlex.quote(f"ckptops-drill-{job_name}"),
        PARTITION=shlex.quote(slurm.partition),
        NODES=slurm.nodes,
        GPUS_PER_NODE=slurm.gpus_per_node,
        TIME_LIMIT=shlex.quote(slurm.time_limit),
        ACCOUNT_LINE=f"#SBATCH --account={shlex.quote(slurm.account)}" if slurm.account else "",
        OUTPUT=shlex.quote(str(report.with_suffix(".slurm.log"))),
        LOAD_DIR=shlex.quote(str(load_dir)),
        CKPT_STEP=iteration,
        REPORT=shlex.quote(str(report)),
        LOAD_COMMAND=shlex.quote(slurm.load_command),
    )


_JOB_ID = re.compile(r"^(\d+)(?:;(\S+))?$", re.MULTILINE)


def _cancel(log: Path) -> str:
    """``sbatch --parsable`` prints ``jobid[;cluster]`` on a line of its own (warnings may come
    first): cancel that job, and say how that went (the timeout stays the drill's error)."""
    found = _JOB_ID.search(log.read_text(errors="replace"))
    if not found:
        return f"no Slurm job id in {log}: cancel it by hand"
    cluster = ["-M", found[2]] if found[2] else []
    try:
        done = subprocess.run(["scancel", *cluster, found[1]], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"scancel {found[1]} failed ({e}): cancel it by hand"
    if done.returncode:
        return f"scancel {found[1]} failed ({done.stderr.strip() or done.returncode}): cancel it by hand"
    return f"Slurm job {found[1]} cancelled"


def load_checkpoint(profile, load_dir: Path, iteration: int, report: Path) -> dict:
    """Load ``load_dir/iter_<iteration>`` for real and return the loader's report."""
    drill = profile.drill
    log = report.with_suffix(".log")
    if drill.launcher == "slurm":
        script = report.with_suffix(".sbatch")
        script.write_text(render_sbatch(drill.slurm, load_dir, iteration, report, profile.job.name))
        try:
            run_reaped(["sbatch", "--parsable", "--wait", str(script)], log, drill.load_timeout_seconds,
                       what="the drill's Slurm job")
        except TimedOut as e:
            # Never leave the allocation running once its scratch is going away.
            raise TimedOut(f"{e}; {_cancel(log)}") from None
    else:
        nproc = profile.local_job.nproc if profile.local_job else profile.job.layout.world_size
        args = ["--load", str(load_dir), "--ckpt-step", str(iteration), "--drill-report", str(report),
                "--tensor-sample", str(drill.tensor_sample)]
        run_reaped(torchrun_command(nproc, args), log, drill.load_timeout_seconds, job_env(), "the drill's load")
    try:
        return json.loads(report.read_text())
    except (OSError, ValueError) as e:
        raise CkptopsError(f"{report}: the drill's load wrote no readable report ({e})") from None

