"""A pending GPU recovery action (``nvidia-smi --query-gpu=gpu_recovery_action``): DCGM's
health watch misses it, and a GPU that needs a reset or a reboot must not take jobs."""

from tasks.health.checks import Context, csv_rows, failed_to_run
from tasks.health.verdict import CheckName, Evidence, HealthCheck, result
from tasks.outcome import Verdict

NAME = CheckName.RECOVERY_ACTION
_ACTIONS = ("reset", "reboot", "drain")  # GPU Reset, Node Reboot, Drain P2P, Drain and Reset


def run(ctx: Context) -> HealthCheck:
    output = ctx.command(
        NAME, ["nvidia-smi", "--query-gpu=index,gpu_recovery_action", "--format=csv,noheader"]
    )
    if output.exit_code and "not a valid field" in (output.stdout + output.stderr).lower():
        return result(
            NAME,
            Verdict.PASS,
            Evidence("gpu_recovery_action not reported by this driver"),
            exit_code=output.exit_code,
        )
    failed = failed_to_run(NAME, output)
    if failed:
        return failed
    rows = [(int(r[0]), r[1]) for r in csv_rows(output.stdout) if len(r) >= 2 and r[0].isdigit()]
    # Only the actions the driver defines fail a node; a value it cannot report is a warning.
    pending = [(gpu, action) for gpu, action in rows if any(w in action.lower() for w in _ACTIONS)]
    unknown = [
        (gpu, action) for gpu, action in rows if (gpu, action) not in pending and action.lower() != "none"
    ]
    if pending:
        return result(
            NAME,
            Verdict.FAIL_HARDWARE,
            *[Evidence(f"GPU {gpu}: recovery action {action} pending", gpu=gpu) for gpu, action in pending],
            exit_code=0,
        )
    if unknown:
        return result(
            NAME,
            Verdict.WARN,
            *[
                Evidence(f"GPU {gpu}: recovery action reported as {action}", gpu=gpu)
                for gpu, action in unknown
            ],
            exit_code=0,
        )
    return result(NAME, Verdict.PASS, Evidence("no recovery action pending"), exit_code=0)
