"""verify-and-promote: a checkpoint counts only once it is proven whole.

Runs on a polling schedule and on ``training.checkpoint.saved`` events (infra/prefect.yaml). Each
run holds the job's concurrency slot and runs the promotion cycle (tasks.checkpoint.promote.promote,
the CLI's) with Prefect tasks for its steps and the profile's wait for a save still being written;
then it publishes the checks and a summary as artifacts and tells the promotion alarm. Last, the
saves' health (tasks.checkpoint.saves): a stalled or failed save, Megatron-LM's tracker ahead of
the data, a tracker naming a checkpoint a plain ``--load`` must not take (tasks.checkpoint.trackers)
or a store that cannot hold the next save fails the run with the alarm's line, and is notified
once through ``notify.block``.
"""

from prefect import flow
from prefect.states import Completed, Failed

from tasks.checkpoint.flow_tasks import PrefectSteps, job_slot, publish, save_health
from tasks.checkpoint.promote import Waiting, promote
from tasks.checkpoint.state import VerifyOptions
from tasks.profile import load_profile
from tasks.watchdog import announce_if_caught_up


@flow(name="verify-and-promote", log_prints=True)
def verify_and_promote(
    profile: str = "local", iteration: int | None = None, wait_timeout_seconds: float | None = None
):
    """Verify new checkpoints and promote the newest valid one (or ``iteration``, if given)."""
    prof = load_profile(profile)
    settings = prof.verify
    options = VerifyOptions.from_profile(prof)
    timeout = settings.wait_timeout_seconds if wait_timeout_seconds is None else wait_timeout_seconds
    with job_slot(prof.job.name, settings.lock_timeout_seconds):
        report = promote(
            prof.job.save_dir,
            options,
            settings.lock_timeout_seconds,
            iteration,
            steps=PrefectSteps(),
            waiting=Waiting(timeout, settings.poll_seconds),
            keep_verified=prof.retention.keep_verified,
        )
    publish(prof.job.name, prof.job.save_dir, report)
    announce_if_caught_up(prof, options)
    problems = report.problems() + save_health(prof, options)
    if problems:
        return Failed(message="; ".join(problems))
    return Completed(message=report.summary())
