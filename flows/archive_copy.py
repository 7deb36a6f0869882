"""archive-copy: the daily full copy of the promoted checkpoint into the independent archive."""

from prefect import flow
from prefect.states import Completed

from tasks.archive.flow_tasks import archive_task, publish_archive_report
from tasks.profile import load_profile


@flow(name="archive-copy", log_prints=True)
def archive_copy(profile: str = "local", force: bool = False):
    """Copy, read back and commit the promoted checkpoint; then apply archive retention."""
    prof = load_profile(profile)
    result = archive_task(prof, force)
    publish_archive_report(prof.job.name, result)
    return Completed(message=f"iteration {result.iteration}: {result.message}")
