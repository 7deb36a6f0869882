"""Thin Prefect wrappers for restore drills, and the artifacts that show them."""

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.restore.drill import DrillReport, run_drill
from tasks.restore.history import continuation_markdown, history, trend_markdown, trend_rows


@task(name="restore-drill", task_run_name="drill-{source}")
def drill_task(profile, source: str, continue_steps: int | None = None) -> DrillReport:
    return run_drill(profile, source, continue_steps=continue_steps)


def phase_rows(report: DrillReport) -> list[dict]:
    rows = [
        {
            "phase": p.name,
            "seconds": round(p.seconds, 3),
            "GB": round(p.bytes / 1e9, 4),
            "GB/s": round(p.gbps, 3),
        }
        for p in report.phases
    ]
    rows.append(
        {
            "phase": "restore window",
            "seconds": round(report.window_seconds, 3),
            "GB": "",
            "GB/s": f"budget {report.budget_seconds:g} s",
        }
    )
    rows += [
        {
            "phase": f"check: {c.name}",
            "seconds": "",
            "GB": "",
            "GB/s": f"{c.outcome}: {c.detail}",
        }
        for c in report.checks
    ]
    return rows


@task(name="publish-drill-report")
def publish_drill_report(profile, report: DrillReport) -> None:
    job = profile.job.name
    create_table_artifact(
        table=phase_rows(report), key=f"drill-{report.source}-{job}", description=report.line()
    )
    if report.continuation_series:
        create_markdown_artifact(
            markdown=continuation_markdown(report.to_dict()),
            key=f"drill-continuation-{job}",
            description="the original and the continued run's loss and learning rate",
        )
    found = history(profile)
    create_table_artifact(
        table=trend_rows(found.drills), key=f"drill-history-{job}", description="every recorded drill"
    )
    create_markdown_artifact(
        markdown=trend_markdown(job, found),
        key=f"drill-trend-{job}",
        description="restore window per drill and source",
    )
