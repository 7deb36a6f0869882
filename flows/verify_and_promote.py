"""verify-and-promote: a checkpoint counts only once it is proven whole.

Runs on a polling schedule and on ``training.checkpoint.saved`` events (infra/prefect.yaml).
Each run, holding the job's lock: verify the checkpoints that need it oldest first (waiting for
any still being saved), move the pointer to the newest that passed, apply retention, and publish
the checks and a summary as artifacts. The steps are the CLI's (tasks.checkpoint.promote), with
Prefect tasks for the verify and wait steps.
"""

from prefect import flow
from prefect.concurrency.sync import concurrency
from prefect.states import Completed, Failed

from tasks.checkpoint.flow_tasks import (
    check_rows,
    ensure_job_limit,
    promote_step,
    publish_report,
    retention,
    summary_markdown,
    tensor_rows,
    verify_one,
    wait_for_save,
)
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.promote import verify_pending
from tasks.checkpoint.state import VerifyOptions
from tasks.profile import load_profile
from tasks.watchdog import announce_if_caught_up

# Prefect's slot acquisition needs a moment even when the slot is free.
_MIN_SLOT_WAIT_SECONDS = 30


@flow(name="verify-and-promote", log_prints=True)
def verify_and_promote(
    profile: str = "local", iteration: int | None = None, wait_timeout_seconds: float | None = None
):
    """Verify new checkpoints and promote the newest valid one (or ``iteration``, if given)."""
    prof = load_profile(profile)
    save_dir = prof.job.save_dir
    options = VerifyOptions.from_profile(prof)
    wait = prof.verify.wait_timeout_seconds if wait_timeout_seconds is None else wait_timeout_seconds
    limit = ensure_job_limit(prof.job.name)
    # The Prefect limit serialises runs across workers and shows who waits in the UI; the file
    # lock also keeps out the CLI and runs from other Prefect servers.
    slot_timeout = max(prof.verify.lock_timeout_seconds, _MIN_SLOT_WAIT_SECONDS)
    with (
        concurrency(limit, occupy=1, strict=True, timeout_seconds=slot_timeout),
        job_lock(save_dir, prof.verify.lock_timeout_seconds) as held,
    ):
        poll = prof.verify.poll_seconds
        # With overlap_save the waiting happens inside the verify step, which reads files early.
        verifications = verify_pending(
            save_dir,
            options,
            iteration,
            verify=lambda it: verify_one(
                save_dir, it, options, held, wait if options.overlap_save else 0, poll
            ),
            wait=None
            if options.overlap_save
            else lambda it: wait_for_save(save_dir, it, options, wait, poll),
        )
        report = promote_step(save_dir, options, iteration)
        report.verifications = verifications
        # A refused promotion (others can write the save directory or what it trusts) deletes nothing.
        plan, deleted = (
            (None, []) if report.refused else retention(save_dir, options, prof.retention.keep_verified)
        )
    publish_report(
        prof.job.name,
        check_rows(verifications),
        summary_markdown(prof, report, plan, deleted),
        tensor_rows(verifications),
    )
    announce_if_caught_up(prof, options)
    if not report.ok:
        return Failed(message="; ".join(report.problems()))
    return Completed(message=report.summary(deleted))
