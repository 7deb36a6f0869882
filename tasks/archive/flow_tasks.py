"""Thin Prefect wrappers for the archive copy, and its summary artifact."""

from prefect import task
from prefect.artifacts import create_markdown_artifact

from tasks.archive.copy import ArchiveResult, archive_checkpoint


@task(name="archive-copy")
def archive_task(profile, force: bool) -> ArchiveResult:
    return archive_checkpoint(profile.job.save_dir, profile, force)


def archive_markdown(job: str, result: ArchiveResult) -> str:
    lines = [
        f"# archive copy: {job}",
        "",
        f"- iteration: **{result.iteration}** -> `{result.location}`",
        f"- {result.message}",
    ]
    if result.committed:
        lines += [
            f"- uploaded {result.uploaded_bytes / 1e9:.3f} GB (reused {result.reused_bytes / 1e9:.3f} GB "
            f"from an earlier interrupted run), "
            + ("read every object back" if result.read_back else "checked by the store's CRC64NVME")
            + f" and committed in {result.seconds:.2f} s ({result.throughput_gbps:.2f} GB/s)",
            f"- archive retention deleted: {result.deleted or 'nothing'}",
            *(f"- {line}" for line in result.kept),
        ]
    return "\n".join(lines) + "\n"


@task(name="publish-archive-report")
def publish_archive_report(job: str, result: ArchiveResult) -> None:
    create_markdown_artifact(
        markdown=archive_markdown(job, result), key=f"archive-{job}", description="archive copy"
    )
