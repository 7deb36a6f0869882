"""GPU count against the expected number (``dcgmi discovery -l``). No GPUs at all, or no GPU
tooling, ends the node's checks here: nothing else can run."""

from tasks.health.checks import Context, not_run
from tasks.health.dcgm import gpu_count
from tasks.health.verdict import CheckName, Evidence, HealthCheck, result
from tasks.outcome import Verdict

NAME = CheckName.GPU_COUNT


def run(ctx: Context) -> HealthCheck:
    output = ctx.command(NAME, ["dcgmi", "discovery", "-l"])
    if output.exit_code == 127:
        return result(
            NAME,
            Verdict.FAIL_CONFIG,
            Evidence("no GPUs found: dcgmi (DCGM) is not installed on this node"),
            exit_code=127,
        )
    failed = not_run(NAME, output)
    if failed:
        return failed
    found = gpu_count(output.stdout)
    expected = ctx.settings.gpus_per_node
    if found is None:
        return result(
            NAME,
            Verdict.TOOL_ERROR,
            Evidence(f"dcgmi discovery exited {output.exit_code} without a GPU count"),
            exit_code=output.exit_code,
        )
    if found == 0:
        return result(
            NAME,
            Verdict.FAIL_CONFIG,
            Evidence("no GPUs found (0 GPUs: no driver, or not a GPU node)", value=0),
            exit_code=output.exit_code,
        )
    if found < expected:
        return result(
            NAME,
            Verdict.FAIL_HARDWARE,
            Evidence(f"{found} of {expected} GPUs found", value=found, gate=expected),
            exit_code=output.exit_code,
        )
    return result(
        NAME,
        Verdict.PASS,
        Evidence(f"{found} GPUs found", value=found, gate=expected),
        exit_code=output.exit_code,
    )


def no_gpus(check: HealthCheck) -> bool:
    return check.name == NAME and check.verdict is Verdict.FAIL_CONFIG
