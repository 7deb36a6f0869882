"""verify-and-promote: a checkpoint counts only once it is proven whole.

Runs on a polling schedule and on ``training.checkpoint.saved`` events (infra/prefect.yaml).
Each run, holding the job's lock: find the complete checkpoints newer than the pointer, wait for
any still being saved, verify them oldest first, move the pointer to the newest that passed,
apply retention, and publish the checks and a summary as artifacts.
"""

from prefect import flow
from prefect.concurrency.sync import concurrency
from prefect.states import Completed, Failed

from tasks.checkpoint.flow_tasks import (
    check_rows,
    ensure_job_limit,
    find_pending,
    promote_newest,
    publish_report,
    retention,
    summary_markdown,
    verify_one,
    wait_for_save,
)
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.state import State, VerifyOptions
from tasks.profile import load_profile

_MIN_SLOT_WAIT_SECONDS = 30


@flow(name="verify-and-promote", log_prints=True)
def verify_and_promote(profile: str = "local", iteration: int | None = None,
                       wait_timeout_seconds: float | None = None):
    """Verify new checkpoints and promote the newest valid one (or ``iteration``, if given)."""
    prof = load_profile(profile)
    save_dir = prof.job.save_dir
    options = VerifyOptions.from_profile(prof)
    wait = prof.verify.wait_timeout_seconds if wait_timeout_seconds is None else wait_timeout_seconds
    limit = ensure_job_limit(prof.job.name)
    # The Prefect limit serialises runs across workers and shows who waits in the UI; the file
    # lock also keeps out the CLI and hosts on other Prefect servers. Prefect's slot acquisition
    # needs a moment even when the slot is free, hence the floor.
    slot_timeout = max(prof.verify.lock_timeout_seconds, _MIN_SLOT_WAIT_SECONDS)
    with concurrency(limit, occupy=1, strict=True, timeout_seconds=slot_timeout), \
            job_lock(save_dir, prof.verify.lock_timeout_seconds):
        previous = read_pointer(save_dir)
        todo = [iteration] if iteration is not None else find_pending(save_dir, options)
        verifications, waited_out = [], []
        for it in todo:
            state, why = wait_for_save(save_dir, it, options, wait, prof.verify.poll_seconds)
            if state is State.IN_PROGRESS:
                waited_out.append((it, why))
                continue
            verifications.append(verify_one(save_dir, it, options))
        current, why = promote_newest(save_dir, options, iteration)
        plan, deleted = retention(save_dir, options, prof.retention.keep_verified)
    publish_report(prof.job.name, check_rows(verifications),
                   summary_markdown(prof, previous, current, why, verifications, waited_out, plan, deleted))
    failed = [v for v in verifications if v.state is State.INVALID]
    if failed:
        return Failed(message="; ".join(v.line() for v in failed))
    done = f"verified {', '.join(str(v.iteration) for v in verifications)}; " if verifications else ""
    kept_waiting = f"; still in progress: {', '.join(str(i) for i, _ in waited_out)}" if waited_out else ""
    gone = f"; retention deleted {', '.join(map(str, deleted))}" if deleted else ""
    return Completed(message=f"{done}latest verified: {current} ({why}){gone}{kept_waiting}")
