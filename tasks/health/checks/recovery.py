"""A pending GPU recovery action (``nvidia-smi --query-gpu=gpu_recovery_action``): DCGM's
health watch misses it, and a GPU that needs a reset or a reboot must not take jobs."""

from tasks.health.checks import Context, csv_rows, failed_to_run
from tasks.health.verdict import CheckResult, Evidence, Verdict, result

NAME = "recovery-action"


def run(ctx: Context) -> CheckResult:
    output = ctx.command(NAME, ["nvidia-smi", "--query-gpu=index,gpu_recovery_action", "--format=csv,noheader"])
    if output.exit_code and "not a valid field" in (output.stdout + output.stderr).lower():
        return result(NAME, Verdict.PASS, Evidence("gpu_recovery_action not reported by this driver"),
                      exit_code=output.exit_code)
    failed = failed_to_run(NAME, output)
    if failed:
        return failed
    pending = [(int(r[0]), r[1]) for r in csv_rows(output.stdout) if len(r) >= 2 and r[0].isdigit()
               and r[1].lower() not in ("none", "[n/a]", "n/a")]
    if pending:
        return result(NAME, Verdict.FAIL_HARDWARE,
                      *[Evidence(f"GPU {gpu}: recovery action {action} pending", gpu=gpu) for gpu, action in pending],
                      exit_code=0)
    return result(NAME, Verdict.PASS, Evidence("no recovery action pending"), exit_code=0)
