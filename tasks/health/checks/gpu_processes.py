"""GPUs held by a dead job: compute processes on the node's GPUs (``nvidia-smi
--query-compute-apps``) whose pid no running Slurm job step on the node owns (``scontrol
listpids``, the pids of every step's process tracking). Such a process keeps GPU memory and
compute from the next job: the node fails (FAIL_CONFIG: kill the processes or reboot, not a
hardware fault) before a relaunch includes it, naming pid, process and GPU."""

from dataclasses import dataclass

from tasks.health.checks import Context, failed_to_run, not_run
from tasks.health.verdict import CheckName, Evidence, HealthCheck, result
from tasks.outcome import Verdict

NAME = CheckName.GPU_PROCESSES
QUERY = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory", "--format=csv"]
HEADER = ("gpu_uuid", "pid", "process_name")
NO_STEPS = "No job steps exist on this node"


@dataclass(frozen=True)
class ComputeApp:
    gpu: str  # the GPU's UUID
    pid: int
    name: str
    memory: str


def compute_apps(text: str) -> list[ComputeApp]:
    """The rows of ``QUERY``'s output. A process name may hold commas (a command line): the
    UUID and pid are read from the left, the memory from the right. ValueError for an output
    that is not this query's (another header, a row without a pid)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or tuple(c.strip() for c in lines[0].split(",")[:3]) != HEADER:
        raise ValueError(f"not a --query-compute-apps output: {lines[0][:80] if lines else 'nothing'}")
    apps = []
    for line in lines[1:]:
        if line.startswith("No running processes found"):
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[1].isdigit():
            raise ValueError(f"not a compute-apps row: {line[:80]}")
        apps.append(ComputeApp(parts[0], int(parts[1]), ",".join(parts[2:-1]).strip(), parts[-1]))
    return apps


def listpids(text: str) -> dict[int, str]:
    """``scontrol listpids``: pid -> its job id (a step's processes, on this node)."""
    owned = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0].isdigit():
            owned[int(fields[0])] = fields[1]
    return owned


def listpids_argv(ctx: Context) -> list[str]:
    argv = ["scontrol", "listpids"]
    if ctx.settings.gpu_processes.listpids_node_name:
        argv += ["*", ctx.node]  # every job, on this node's slurmd
    return argv


def owned_pids(ctx: Context) -> dict[int, str] | HealthCheck:
    """The pids of the running job steps on the node, or the TOOL_ERROR that says why not."""
    output = ctx.command(NAME, listpids_argv(ctx))
    failed = not_run(NAME, output)
    if failed:
        return failed
    said = (output.stdout + output.stderr).strip()
    if output.exit_code == 0:
        return listpids(output.stdout)
    if NO_STEPS in said and "error" not in said.lower():
        return {}
    lines = said.splitlines() or [""]
    why = next((line for line in lines if "error" in line.lower()), lines[-1])
    return result(
        NAME,
        Verdict.TOOL_ERROR,
        Evidence(f"scontrol listpids exited {output.exit_code}: {why[:200]}"),
        exit_code=output.exit_code,
    )


def counted(n: int) -> str:
    return f"{n} compute process{'es' if n > 1 else ''}"


def run(ctx: Context) -> HealthCheck:
    output = ctx.command(NAME, QUERY)
    failed = failed_to_run(NAME, output)
    if failed:
        return failed
    try:
        apps = compute_apps(output.stdout)
    except ValueError as e:
        return result(NAME, Verdict.TOOL_ERROR, Evidence(f"nvidia-smi: {e}"), exit_code=0)
    if not apps:
        return result(NAME, Verdict.PASS, Evidence("no compute processes on the GPUs"), exit_code=0)
    owned = owned_pids(ctx)
    if isinstance(owned, HealthCheck):
        return owned
    orphans = [a for a in apps if a.pid not in owned]
    if not orphans:
        jobs = sorted(set(owned[a.pid] for a in apps))
        return result(
            NAME,
            Verdict.PASS,
            Evidence(f"{counted(len(apps))}, all in running Slurm jobs ({', '.join(jobs)})"),
            exit_code=0,
        )
    evidence = [
        Evidence(
            f"GPU {a.gpu}: pid {a.pid} ({a.name}, {a.memory}) belongs to no running Slurm job",
            value=a.pid,
        )
        for a in orphans
    ]
    if len(orphans) > 1:
        evidence[0].detail += f" (and {len(orphans) - 1} more)"
    return result(NAME, Verdict.FAIL_CONFIG, *evidence, exit_code=0)
