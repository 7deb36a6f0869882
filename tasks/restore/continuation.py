"""The continuation drill: train the job from the restored copy for K iterations and compare its
log with the original run's for those iterations.

The job starts from its own batch script (``drill.continuation.script``, default
``recovery.script``) with ``CKPT_LOAD`` (the restored copy's save directory), ``CKPT_STEP=N``,
``CKPT_EXIT_INTERVAL=N+K`` and ``CKPT_LOG`` in its environment and ``--ckpt-step N`` after it: a
Megatron-LM script passes ``--load "$CKPT_LOAD" --ckpt-step "$CKPT_STEP" --exit-interval
"$CKPT_EXIT_INTERVAL"``, no ``--save``, and writes its output to ``$CKPT_LOG``. The reference is
the original run's own log (``drill.continuation.reference``, default ``recovery.step_records``):
nothing is compared that it has not logged yet. The comparison is post-resume validation's
(``Validator.continuation``): resume point, learning rate, loss and grad norm where both runs
printed them over the same iterations, skipped and NaN steps.
"""

import os
import re
from pathlib import Path

from tasks.checkpoint.facts import checkpoint_facts
from tasks.cluster import process
from tasks.errors import CkptopsError, UsageError
from tasks.outcome import Check, Outcome
from tasks.resume.checks import Validator
from tasks.resume.records import load_steps

# Relative tolerance of the loss and grad norm, by the profile's word.
TOLERANCES = {"exact": 0.0, "fp32": 1e-6, "bf16": 5e-3}
# Megatron-LM prints its arguments at start: "  save ........ /path" (None when not saving).
_SAVE_ARG = re.compile(r"^\s*save \.+ (\S+)\s*$", re.M)


def continuation_sources(profile) -> tuple[Path, Path]:
    """The job's batch script and the original run's log, checked before anything is restored."""
    settings, recovery = profile.drill.continuation, profile.recovery
    script = settings.script or (recovery.script if recovery else None)
    reference = settings.reference or (recovery.step_records if recovery else None)
    if script is None:
        raise UsageError(
            f"{profile.source}: drill.continuation.script (or recovery.script): the job's batch script"
        )
    if reference is None:
        raise UsageError(
            f"{profile.source}: drill.continuation.reference (or recovery.step_records): "
            "the original run's log"
        )
    script = Path(script)
    try:
        text = script.read_text(errors="replace")
    except OSError as e:
        raise UsageError(f"{script}: the job's batch script cannot be read ({e.strerror})") from None
    if "CKPT_LOAD" not in text:
        raise UsageError(
            f"{script}: does not read CKPT_LOAD: it would train from, and save into, the job's own "
            "checkpoints (docs/archive-and-drills.md#the-continuation-drill: the lines a script needs)"
        )
    return script, Path(reference)


def continue_training(
    profile, sources: tuple[Path, Path], restored: Path, scratch: Path, steps: int
) -> tuple[Outcome, str, list[Check]]:
    """Train ``steps`` iterations on from the restored checkpoint ``restored`` (its
    ``iter_NNNNNNN`` directory) with ``sources`` (``continuation_sources``: the script and the
    original run's log) and compare: the outcome, what it says, and the comparison's checks."""
    script, reference = sources
    facts = checkpoint_facts(restored)
    n = facts.iteration
    try:
        before = load_steps(reference)
    except FileNotFoundError:
        raise UsageError(f"{reference}: the original run's log is not there") from None
    logged = {int(i) for i in before.iteration}
    wanted = set(range(n + 1, n + steps + 1))
    if not wanted <= logged:
        last = max(logged, default=0)
        return (
            Outcome.UNCHECKED,
            f"not checkable yet: the original run has logged up to iteration {last}, "
            f"the {steps} after {n} are needed",
            [],
        )
    save_dir = str(profile.job.save_dir.resolve())
    argv = ["bash", str(script), "--ckpt-step", str(n)]
    log = scratch / "continuation.log"
    env = {
        **os.environ,
        "CKPT_LOAD": str(restored.parent),
        "CKPT_STEP": str(n),
        "CKPT_EXIT_INTERVAL": str(n + steps),
        "CKPT_LOG": str(log),
    }
    launcher_log = scratch / "continuation-launcher.log"
    process.run(argv, launcher_log, profile.drill.continuation.timeout_seconds, env, "the continuation run")
    output = log if log.is_file() and log.stat().st_size else launcher_log
    saved_to = {
        Path(p).resolve() for p in _SAVE_ARG.findall(output.read_text(errors="replace")) if p != "None"
    }
    if Path(save_dir) in saved_to:
        raise CkptopsError(
            f"{script}: the continuation ran with --save {save_dir}, the job's own save directory"
        )
    after = load_steps(output)
    reached = int(after.iteration.max()) if len(after) else n
    settings = profile.resume.model_copy(
        update={"loss_rel_tolerance": TOLERANCES[profile.drill.continuation.tolerance]}
    )
    checks = Validator(facts, before, after, settings, None).continuation().checks
    failed = [c for c in checks if c.failed]
    tolerance = profile.drill.continuation.tolerance
    if reached < n + steps:
        return Outcome.FAIL, f"the continuation stopped at iteration {reached}, before {n + steps}", checks
    if failed:
        return (
            Outcome.FAIL,
            f"iterations {n + 1}-{n + steps} differ from the original run ({failed[0].name})",
            checks,
        )
    return (
        Outcome.PASS,
        f"iterations {n + 1}-{n + steps} trained from the restored copy match the original run's log "
        f"({tolerance})",
        checks,
    )
