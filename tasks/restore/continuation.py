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

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from tasks.checkpoint.facts import checkpoint_facts
from tasks.checkpoint.manifest import Manifest
from tasks.cluster import process
from tasks.errors import CkptopsError, UsageError
from tasks.outcome import Check, Outcome
from tasks.restore.launch import allocation_options, sbatch_wait
from tasks.resume.checks import Validator
from tasks.resume.compat import Kind, checkpoint_fit
from tasks.resume.records import Steps, load_steps

# Relative tolerance of the loss and grad norm at the first iteration and after it, by the
# profile's word (bf16 as NeMo Automodel's resume tests hold it).
TOLERANCES = {"exact": (0.0, 0.0), "fp32": (1e-6, 1e-6), "bf16": (1e-6, 5e-3)}
ARGUMENTS = "relaunch arguments"  # the job's script against the checkpoint (tasks.resume.compat)
# Megatron-LM prints its arguments at start: "  save ........ /path" (None when not saving).
_SAVE_ARG = re.compile(r"^\s*save \.+ (\S+)\s*$", re.M)


@dataclass
class Continued:
    """A continuation's outcome, what it says, the comparison's checks, and the largest relative
    difference of the losses and grad norms it compared."""

    outcome: Outcome
    detail: str
    checks: list[Check] = field(default_factory=list)
    largest_difference: float | None = None
    series: dict | None = None  # per iteration, both runs' loss and learning rate (``series``)


def continuation_sources(profile) -> tuple[Path, Steps]:
    """The job's batch script and the original run's log (read once, here), checked before
    anything is restored."""
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
    try:
        return script, load_steps(reference)
    except FileNotFoundError:
        raise UsageError(f"{reference}: the original run's log is not there") from None


def checkable_up_to(before: Steps, steps: int) -> int | None:
    """The newest checkpoint iteration whose next ``steps`` iterations the original run
    (``before``, its log) has logged: its last iteration less ``steps``; None when it has none."""
    return int(before.iteration.max()) - steps if len(before) else None


def continue_training(
    profile,
    sources: tuple[Path, Steps],
    restored: Path,
    scratch: Path,
    steps: int,
    log: Path,
    manifest: Manifest,
) -> Continued:
    """Train ``steps`` iterations on from the restored checkpoint ``restored`` (its
    ``iter_NNNNNNN`` directory, copied by ``manifest``) with ``sources``
    (``continuation_sources``: the script and the original run's log) and compare. The run's
    output goes to ``log``, which the caller keeps."""
    script, before = sources
    facts = checkpoint_facts(restored)
    facts.data_version = manifest.data_version  # the copy has the files, the job's manifest the facts
    n = facts.iteration
    logged = {int(i) for i in before.iteration}
    wanted = set(range(n + 1, n + steps + 1))
    if not wanted <= logged:
        last = max(logged, default=0)
        return Continued(
            Outcome.UNCHECKED,
            f"not checkable yet: the original run has logged up to iteration {last}, "
            f"the {steps} after {n} are needed",
        )
    save_dir = str(profile.job.save_dir.resolve())
    env = {
        **os.environ,
        "CKPT_LOAD": str(restored.parent),
        "CKPT_STEP": str(n),
        "CKPT_EXIT_INTERVAL": str(n + steps),
        "CKPT_LOG": str(log),
    }
    fits = checkpoint_fit(profile, restored, script, env)
    if fits.refused or fits.needs_approval:
        # The drill fails, and the checkpoint is not blamed (not checked, nothing certified): the
        # script would not resume it as the original run went.
        said = f"{script} does not fit checkpoint {n}: " + "; ".join(
            d.words for d in fits.refused + fits.needs_approval
        )
        return Continued(Outcome.UNCHECKED, "not run", [Check(ARGUMENTS, Outcome.FAIL, said)])
    warned = [Check(ARGUMENTS, Outcome.WARN, d.words) for d in fits.of(Kind.WARN)]
    launcher_log = scratch / "continuation-launcher.log"
    try:
        _launch(profile, [str(script), "--ckpt-step", str(n)], launcher_log, env)
    except process.Failed as e:
        if not _written(log):
            raise
        raise CkptopsError(f"{log}: the continuation run exited {e.code}: {process.tail(log)}") from None
    output = log if _written(log) else launcher_log
    saved_to = {
        Path(p).resolve() for p in _SAVE_ARG.findall(output.read_text(errors="replace")) if p != "None"
    }
    if Path(save_dir) in saved_to:
        raise CkptopsError(
            f"{script}: the continuation ran with --save {save_dir}, the job's own save directory"
        )
    after = load_steps(output)
    reached = int(after.iteration.max()) if len(after) else n
    first, later = TOLERANCES[profile.drill.continuation.tolerance]
    settings = profile.resume.model_copy(update={"loss_rel_tolerance": later, "first_rel_tolerance": first})
    validation = Validator(facts, before, after, settings, None).continuation()
    checks, largest = warned + validation.checks, validation.largest_difference
    drawn = series(before, after, n + 1, n + steps)
    failed = [c for c in checks if c.failed]
    tolerance = profile.drill.continuation.tolerance
    if reached < n + steps:
        stopped = f"the continuation stopped at iteration {reached}, before {n + steps}"
        return Continued(Outcome.FAIL, stopped, checks, largest, drawn)
    if failed:
        differ = f"iterations {n + 1}-{n + steps} differ from the original run ({failed[0].name})"
        return Continued(Outcome.FAIL, differ, checks, largest, drawn)
    return Continued(
        Outcome.PASS,
        f"iterations {n + 1}-{n + steps} trained from the restored copy match the original run's log "
        f"({tolerance})",
        checks,
        largest,
        drawn,
    )


def _launch(profile, argv: list[str], log: Path, env: dict) -> None:
    """The job's script to its end: with bash here, or submitted to the drill's partition and
    account on Slurm (its own ``#SBATCH`` lines size it: a comparison needs the original's world)."""
    drill = profile.drill
    timeout, what = drill.continuation.timeout_seconds, "the continuation run"
    if drill.launcher != "slurm":
        process.run(["bash", *argv], log, timeout, env, what)
        return
    options = [f"--job-name=ckptops-continue-{profile.job.name}", f"--output={log.with_suffix('.job.log')}"]
    sbatch_wait([*options, *allocation_options(drill.slurm), *argv], log, timeout, what, env)


def _written(log: Path) -> bool:
    return log.is_file() and log.stat().st_size > 0


def series(before: Steps, after: Steps, first: int, last: int) -> dict:
    """Iterations ``first``..``last`` with each run's loss and learning rate (None where a run
    did not log one; an iteration's last record wins, a rerun's), for the drill's plot."""

    def by_iteration(steps: Steps, name: str) -> dict[int, float]:
        values = getattr(steps, name)
        return {int(i): float(v) for i, v in zip(steps.iteration, values) if first <= i <= last}

    iterations = list(range(first, last + 1))
    drawn = {"iteration": iterations}
    for side, steps in (("original", before), ("continued", after)):
        for name in ("loss", "lr"):
            found = by_iteration(steps, name)
            drawn[f"{side}_{name}"] = [
                found[i] if i in found and math.isfinite(found[i]) else None for i in iterations
            ]
    return drawn
