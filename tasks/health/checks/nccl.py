"""nccl-tests on one node with all its GPUs (``all_reduce_perf``), gated on bus bandwidth."""

from tasks.health.checks import Context, not_run
from tasks.health.nccl import Gates, classify_allreduce
from tasks.health.verdict import CheckName, HealthCheck

NAME = CheckName.NCCL


def run(ctx: Context) -> HealthCheck:
    nccl = ctx.settings.nccl
    output = ctx.command(NAME, list(nccl.command), nccl.timeout_seconds)
    failed = not_run(NAME, output)
    if failed:
        return failed
    gates = Gates.from_settings(nccl, ctx.settings.pairs)
    return classify_allreduce(output.stdout + output.stderr, output.exit_code, gates, NAME)
