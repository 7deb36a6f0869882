"""NVLink state (``dcgmi nvlink -s``): any link Down is a hardware failure."""

from tasks.health.checks import Context, failed_to_run
from tasks.health.dcgm import nvlink_down
from tasks.health.verdict import CheckName, Evidence, HealthCheck, result
from tasks.outcome import Verdict

NAME = CheckName.NVLINK


def run(ctx: Context) -> HealthCheck:
    output = ctx.command(NAME, ["dcgmi", "nvlink", "-s"])
    failed = failed_to_run(NAME, output)
    if failed:
        return failed
    down = nvlink_down(output.stdout)
    if down:
        return result(
            NAME,
            Verdict.FAIL_HARDWARE,
            *[Evidence(f"GPU {gpu}: NVLink {links} down", gpu=gpu) for gpu, links in sorted(down.items())],
            exit_code=0,
        )
    return result(NAME, Verdict.PASS, Evidence("no NVLink down"), exit_code=0)
