"""post-resume-validation: prove that a resumed run continues exactly where it stopped.

Compares the resumed run's step records (or Megatron-LM log) with the run before the failure:
resume point, learning rate, data order, recomputed loss and grad norm, peak memory, throughput,
skipped and NaN iterations. Publishes the checks, and emits ``training.resume.validated`` or
``training.resume.rejected`` for the job.
"""

from pathlib import Path

from prefect import flow
from prefect.states import Completed, Failed

from tasks.notify import send
from tasks.profile import load_profile
from tasks.resume.flow_tasks import publish_validation, validate_task


@flow(name="post-resume-validation", log_prints=True)
def post_resume_validation(
    after: str, before: str | None = None, checkpoint: str | None = None, profile: str = "local"
):
    """``checkpoint`` defaults to the promoted one; ``before`` to the stored baseline."""
    prof = load_profile(profile)
    result = validate_task(
        prof, Path(after), Path(before) if before else None, Path(checkpoint) if checkpoint else None
    )
    publish_validation(prof.job.name, result)
    if result.ok:
        return Completed(message=result.line())
    unsent = send(prof, "resume rejected", result.line())
    return Failed(message=result.line() + (f"; {unsent}" if unsent else ""))
