"""Row remapping (``nvidia-smi --query-remapped-rows``): a remap failure means the GPU's memory
can no longer hide its bad rows (drain); a remap pending needs a GPU reset."""

from tasks.health.checks import Context, csv_rows, failed_to_run
from tasks.health.verdict import CheckName, Evidence, HealthCheck, result
from tasks.outcome import Verdict, worst

NAME = CheckName.ROW_REMAP
_YES = {"1", "yes", "true"}


def run(ctx: Context) -> HealthCheck:
    output = ctx.command(
        NAME,
        [
            "nvidia-smi",
            "--query-remapped-rows=gpu_bus_id,remapped_rows.failure,remapped_rows.pending",
            "--format=csv,noheader",
        ],
    )
    failed = failed_to_run(NAME, output)
    if failed:
        return failed
    findings = []
    for row in csv_rows(output.stdout):
        if len(row) < 3:
            continue
        bus, failure, pending = row[0], row[1].lower(), row[2].lower()
        if failure in _YES:
            findings.append((Verdict.FAIL_HARDWARE, Evidence(f"GPU {bus}: row remapping failed")))
        elif pending in _YES:
            findings.append((Verdict.WARN, Evidence(f"GPU {bus}: row remap pending (reset the GPU)")))
    if not findings:
        return result(NAME, Verdict.PASS, Evidence("no row-remap failure or pending remap"), exit_code=0)
    return result(NAME, worst(v for v, _ in findings), *[e for _, e in findings], exit_code=0)
