"""Post-resume validation: does a resumed run continue exactly where it stopped?

The checks are tasks.relaunch.continuity's (any run started from a checkpoint) and
tasks.resume.checks' (the job's own resume), the steady state before the failure
tasks.resume.baseline; this is their composition for the CLI, the flow and the recovery run.
"""

from collections.abc import Sequence
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.facts import checkpoint_facts
from tasks.checkpoint.manifest import UNCHECKED, read_manifest
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.signing import Trust
from tasks.checkpoint.state import VerifyOptions
from tasks.errors import UsageError
from tasks.job.step_records import Steps
from tasks.outcome import Check, Outcome
from tasks.relaunch.continuity import ResumeCheck, Validation
from tasks.resume.baseline import make_baseline, store_baseline, stored_baseline
from tasks.resume.checks import Validator


def validate_resume(
    checkpoint: Path,
    before: Steps | None,
    after: Steps,
    settings,
    verified_now: bool = False,
    relaunched: dict[str, dict | None] | None = None,
    trust: Trust = UNCHECKED,
    skip: Sequence[int] = (),
) -> Validation:
    """Validate ``after`` (the resumed run) against ``before`` (the run before the failure).
    ``verified_now``: the checkpoint was verified by this validation, not before the resume.
    ``relaunched``: the resumed job's nodes and their recorded conformance facts (None for a
    node never read), which a throughput drop is explained with. ``trust``: the job's signing
    policy, its checkpoint's manifest read under it before anything of it is loaded. ``skip``:
    iterations the run was told to pass untrained (a relaunch past a data failure)."""
    facts = checkpoint_facts(checkpoint, trust)
    note = None
    if before is not None:
        baseline = make_baseline(before, facts, settings)
        note = store_baseline(facts, baseline)
        if note and baseline["throughput_median"] is None and baseline["peak_memory_median"] is None:
            baseline = stored_baseline(facts)
    else:
        baseline = stored_baseline(facts)
    result = Validator(facts, before, after, settings, baseline, verified_now, relaunched, skip).run()
    if note:
        result.checks.append(Check(ResumeCheck.BASELINE, Outcome.UNCHECKED, note))
    return result


def verify_if_never_verified(directory: Path, profile) -> bool:
    """Verify a checkpoint that has no manifest, as promote would (under the job lock, writing its
    manifest); True if it did. A resume may have started from a save ckptops had not reached yet."""
    from tasks.checkpoint.promote import recording

    options = VerifyOptions.from_profile(profile, directory.parent)
    if read_manifest(directory, options.trust) is not None:
        return False
    with recording(directory.parent, profile.verify.lock_timeout_seconds) as recorder:
        if read_manifest(directory, options.trust) is not None:  # verified by a promotion meanwhile
            return False
        recorder.verify(layout.parse_iter_dir(directory.name), options)
    return read_manifest(directory, options.trust) is not None


def validate(profile, after: Path, before: Path | None = None, checkpoint: Path | None = None) -> Validation:
    """Post-resume validation as the CLI and the flow run it: the checkpoint (default: the promoted
    one) verified now if nothing ever verified it, the records or Megatron-LM logs read, every check
    run, the baseline stored with the job."""
    from tasks.job.step_records import load_steps

    if checkpoint is None:
        iteration = read_pointer(profile.job.save_dir)
        if iteration is None:
            raise UsageError(
                f"{profile.job.save_dir}: nothing promoted; name the checkpoint the run resumed from"
            )
        checkpoint = profile.job.save_dir / layout.iter_dir_name(iteration)
    checkpoint = Path(checkpoint)
    if layout.parse_iter_dir(checkpoint.name) is None or not checkpoint.is_dir():
        raise UsageError(f"{checkpoint}: not a checkpoint directory (expected iter_NNNNNNN)")
    verified_now = verify_if_never_verified(checkpoint, profile)
    before_steps = load_steps(before) if before else None
    trust = Trust.of(profile, checkpoint.parent)
    return validate_resume(
        checkpoint, before_steps, load_steps(after), profile.resume, verified_now, trust=trust
    )
