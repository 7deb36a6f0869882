"""Thin Prefect wrappers for post-resume validation: the check, its artifacts and its event."""

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.events import emit_event

from tasks.events import RESUME_REJECTED, RESUME_VALIDATED
from tasks.relaunch.continuity import Validation
from tasks.resume.validate import validate


@task(name="validate-resume")
def validate_task(profile, after: Path, before: Path | None, checkpoint: Path | None) -> Validation:
    return validate(profile, after, before, checkpoint)


def check_rows(result: Validation) -> list[dict]:
    return [
        {
            "check": c.name,
            "result": c.outcome.value,
            "expected": c.expected,
            "observed": c.observed,
            "detail": c.detail,
        }
        for c in result.checks
    ]


@task(name="publish-resume-validation")
def publish_validation(job: str, result: Validation) -> None:
    create_table_artifact(table=check_rows(result), key=f"resume-checks-{job}", description=result.line())
    baseline = result.baseline or {}
    create_markdown_artifact(
        key=f"resume-summary-{job}",
        description="post-resume validation",
        markdown=(
            f"# post-resume validation: {job}\n\n**{result.line()}**\n\n"
            f"- checkpoint: `{result.checkpoint}`\n"
            f"- baseline: iterations {baseline.get('iterations')} of `{baseline.get('source')}` "
            f"(stored {baseline.get('created_at')})\n"
        ),
    )
    emit_event(
        event=RESUME_VALIDATED if result.ok else RESUME_REJECTED,
        resource={"prefect.resource.id": f"ckptops.job.{job}"},
        payload={
            "checkpoint": result.checkpoint,
            "iteration": result.iteration,
            "failed": [c.name for c in result.failures],
            "summary": result.line(),
        },
    )
