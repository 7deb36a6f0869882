"""Where a drill loads the restored checkpoint: the local job on this machine, or a Slurm drill
allocation on the cluster. Either way the loader writes a JSON report of what it loaded."""

import json
import os
import shlex
import subprocess
from pathlib import Path
from string import Template

from infra.local_job.launch import job_env, torchrun_command
from tasks.errors import CkptopsError

SBATCH_TEMPLATE = Path(__file__).resolve().parents[2] / "infra" / "slurm" / "restore_drill.sbatch"


def _run(command: list[str], log: Path, timeout_seconds: float, env: dict | None = None) -> None:
    """Run a command in its own process group; kill the whole group on timeout."""
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = process.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(process.pid, 9)
            except ProcessLookupError:
                pass
            process.wait()
    if code != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        what = f"timed out after {timeout_seconds:.0f}s" if code is None else f"exited {code}"
        raise CkptopsError(f"{log}: the drill's load {what}: {tail}")


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


def load_checkpoint(profile, load_dir: Path, iteration: int, report: Path) -> dict:
    """Load ``load_dir/iter_<iteration>`` for real and return the loader's report."""
    drill = profile.drill
    log = report.with_suffix(".log")
    if drill.launcher == "slurm":
        script = report.with_suffix(".sbatch")
        script.write_text(render_sbatch(drill.slurm, load_dir, iteration, report, profile.job.name))
        _run(["sbatch", "--parsable", "--wait", str(script)], log, drill.load_timeout_seconds)
    else:
        nproc = profile.local_job.nproc if profile.local_job else profile.job.layout.world_size
        args = ["--load", str(load_dir), "--ckpt-step", str(iteration), "--drill-report", str(report),
                "--tensor-sample", str(drill.tensor_sample)]
        _run(torchrun_command(nproc, args), log, drill.load_timeout_seconds, job_env())
    try:
        return json.loads(report.read_text())
    except (OSError, ValueError) as e:
        raise CkptopsError(f"{report}: the drill's load wrote no readable report ({e})") from None

