"""Stop rules: when a recovery must not relaunch but page a human. A pure function of the job's
incident ledger, the new failure and the promoted checkpoint.

Relaunching is cheap; relaunching into the same failure again and again burns GPU-hours and
hides the real problem (a bad batch, a code bug, a memory regression). Each rule has a name, and
every rule's verdict is kept in the incident, fired or not, so the approver sees why.

Budget reset: a newer checkpoint promoted since the earlier failures means the job made real
progress since; the recurrence rules then count only failures from that checkpoint on. A pointer
rolled back (a fall back, an approver's older pick) is not progress. The hourly cap is
a rate limit and counts every relaunch.

A data failure (Megatron's rerun state machine reproduced a rejected result on another GPU) is
relaunched past its window once: a numerical or data failure again at a position a relaunch
skipped stops (``data-after-skip``); each cause at each position is tried at most twice
(``same-failure-again``).

Only recoveries that relaunched the job count (a running one that has relaunched too): one that
stopped, was aborted or was interrupted before relaunching cost nothing and proved nothing. And
an incident of this very failure (its key) is a retry of it, never a recurrence.
"""

from dataclasses import asdict, dataclass

from tasks.recovery.ledger import Incident
from tasks.recovery.triage.model import FailureClass

# How many times the same failure at the same place is retried before a human looks.
SAME_FAILURE_RETRIES = 1
NO_PROGRESS_RECOVERIES = 3


@dataclass(frozen=True)
class Rule:
    name: str
    fired: bool
    detail: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Failure:
    """What the stop rules need to know about the new failure."""

    cls: str
    iteration: int | None
    exit_code: int | None
    promoted: int | None  # the promoted iteration now
    at: float
    key: str | None = None  # the failure's key (tasks.recovery.run.failure_key)
    infrastructure: str | None = None  # the nodes were taken away (a preemption): triage's line
    position: int | None = None  # a numerical or data failure's iteration: where in the data


def _relaunched(incident: Incident) -> bool:
    return incident.relaunched_job is not None


def _since_progress(history: list[Incident], promoted: int | None) -> list[Incident]:
    """Earlier incidents with no progress since. The same checkpoint promoted as at their failure:
    none. A pointer rolled back (a fall back) is no progress either, until the job has promoted a
    checkpoint newer than the one that incident relaunched from: a rollback from 5000 to 4000
    and a promotion of 4800 since is progress."""
    if promoted is None:
        return [i for i in history if i.promoted_at_failure is None]
    return [
        i
        for i in history
        if i.promoted_at_failure is not None and (promoted == i.promoted_at_failure or promoted <= _loaded(i))
    ]


def _loaded(incident: Incident) -> int:
    """The checkpoint ``incident``'s relaunch loaded, at most the one promoted at its failure
    (that one, for an incident that records none)."""
    promoted, loaded = incident.promoted_at_failure, incident.checkpoint
    return promoted if loaded is None else min(promoted, loaded)


def _attempts(failure: Failure, history: list[Incident]) -> list[Incident]:
    return [i for i in history if _relaunched(i) and (failure.key is None or i.failure_key != failure.key)]


def soon_after_resume(failure: Failure, history: list[Incident], within: int | None) -> Incident | None:
    """The last relaunch, if ``failure`` is numerical and came at most ``within`` iterations after
    the checkpoint that relaunch loaded (Megatron-LM #5281: NaN three iterations after every load
    of a corrupt checkpoint, 44 restarts in a row): that checkpoint is suspect."""
    attempts = _attempts(failure, history)
    last = attempts[-1] if attempts else None
    if (
        within is None
        or last is None
        or failure.cls != FailureClass.NUMERICS
        or last.checkpoint is None
        or failure.iteration is None
        or not 0 <= failure.iteration - last.checkpoint <= within
    ):
        return None
    return last


def stop_rules(
    failure: Failure, history: list[Incident], max_per_hour: int, fallback_within: int | None = None
) -> list[Rule]:
    """Every rule's verdict for ``failure``, given the job's earlier incidents (oldest first).
    ``fallback_within``: recovery.fallback_within_iterations (``soon_after_resume``). A failure
    the infrastructure caused fires none of the budgets (recurrence, progress, the hourly cap)."""
    if failure.infrastructure:
        return _infrastructure_rules(failure)
    # The budgets count the job's own failures: a preemption's relaunch is no fault of the job's
    # (it still is the last relaunch soon_after_resume looks at: its load may be the suspect one).
    attempts = [i for i in _attempts(failure, history) if not i.infrastructure]
    recent = _since_progress(attempts, failure.promoted)
    same = [
        i
        for i in recent
        if i.cls == failure.cls and failure.iteration is not None and i.failure_iteration == failure.iteration
    ]
    hour = [i for i in attempts if failure.at - i.times.get("detected", 0) < 3600]
    stuck = recent
    reproduced = [i for i in recent if i.cls == FailureClass.NUMERICS]
    # Numerics soon after a resume: the checkpoint it loaded is suspect, and one fall back to the
    # checkpoint before it is tried before a human is paged; after a fall back, it is not the
    # checkpoint.
    resumed = soon_after_resume(failure, history, fallback_within)
    fell_back = [i for i in reproduced if i.fallback_from is not None]
    may_fall_back = resumed is not None and not fell_back
    return [
        Rule(
            "same-failure-again",
            len(same) >= SAME_FAILURE_RETRIES and not may_fall_back,
            f"{failure.cls} at iteration {failure.iteration} "
            + (
                f"already happened in {', '.join(i.id for i in same)} with no checkpoint progress since"
                + (
                    "; soon after its resume: falling back to the checkpoint before first"
                    if may_fall_back
                    else ""
                )
                if same
                else "not seen before since the last promotion"
            ),
        ),
        Rule(
            "no-checkpoint-progress",
            len(stuck) >= NO_PROGRESS_RECOVERIES,
            f"{len(stuck)} recoveries since checkpoint {failure.promoted} was promoted "
            f"(stop at {NO_PROGRESS_RECOVERIES})",
        ),
        Rule(
            "too-many-per-hour",
            len(hour) >= max_per_hour,
            f"{len(hour)} relaunches in the last hour; this one would exceed recovery.max_per_hour "
            f"= {max_per_hour}"
            if len(hour) >= max_per_hour
            else f"{len(hour)} relaunches in the last hour (at most {max_per_hour})",
        ),
        Rule(
            "numerics-reproduced",
            failure.cls == FailureClass.NUMERICS and bool(reproduced) and not may_fall_back,
            _numerics_detail(failure, reproduced, fell_back, may_fall_back),
        ),
        Rule(
            "out-of-memory",
            failure.cls == FailureClass.OOM,
            "out of memory comes back on any node: the job's memory use must change"
            if failure.cls == FailureClass.OOM
            else "not an out-of-memory failure",
        ),
        *_verdict_rules(failure, history),
    ]


# Classes the rerun state machine's exit 17 comes with when it told the data from the GPU.
_RERUN_VERDICTS = (FailureClass.DATA, FailureClass.HARDWARE)


def _verdict_rules(failure: Failure, history: list[Incident]) -> list[Rule]:
    """The rules on what Megatron said: a data position skipped before, an exit 17 without a
    rerun verdict."""
    skipped = _skipped_before(failure, history)
    return [
        Rule(
            "data-after-skip",
            skipped is not None,
            f"{failure.cls} at iteration {failure.position} again after {skipped.id} relaunched past "
            f"iterations {skipped.skipped['iterations']}: skipping did not get past it"
            if skipped is not None
            else "no failure at a data position an earlier relaunch skipped",
        ),
        Rule(
            "result-validation-failed",
            failure.exit_code == 17 and failure.cls not in _RERUN_VERDICTS,
            "Megatron exited 17: its result validation failed (a rerun gave a different result)"
            if failure.exit_code == 17 and failure.cls not in _RERUN_VERDICTS
            else f"exit code {failure.exit_code}, {failure.cls}: "
            + ("the rerun state machine named the cause" if failure.exit_code == 17 else "not Megatron's 17"),
        ),
    ]


def _skipped_before(failure: Failure, history: list[Incident]) -> Incident | None:
    """The earlier incident whose relaunch skipped the data position this numerical or data
    failure is at."""
    position = failure.position
    if failure.cls not in (FailureClass.DATA, FailureClass.NUMERICS) or position is None:
        return None
    for incident in reversed(history):
        skipped = incident.skipped
        if skipped and skipped["confirmed"] and _relaunched(incident) and position in skipped["iterations"]:
            return incident
    return None


def _infrastructure_rules(failure: Failure) -> list[Rule]:
    why = f"the infrastructure took the nodes away ({failure.infrastructure}): not counted"
    budgets = ("same-failure-again", "no-checkpoint-progress", "too-many-per-hour")
    others = ("numerics-reproduced", "out-of-memory", "data-after-skip", "result-validation-failed")
    return [Rule(name, False, why) for name in budgets] + [
        Rule(name, False, f"{failure.cls}, not this rule's failure") for name in others
    ]


def _numerics_detail(
    failure: Failure, reproduced: list[Incident], fell_back: list[Incident], may_fall_back: bool
) -> str:
    if failure.cls != FailureClass.NUMERICS or not reproduced:
        return "no numerics failure after a resume"
    if fell_back:
        last = fell_back[-1]
        return (
            f"numerics again after {last.id} fell back from checkpoint {last.fallback_from} to "
            f"{last.checkpoint}: not the checkpoint, the data or the code"
        )
    if may_fall_back:
        return (
            f"numerics again soon after the resume of {reproduced[-1].id}: "
            "falling back to the checkpoint before the one it loaded"
        )
    return f"numerics again after the resume of {reproduced[-1].id}: the data or the code, not a node"


def fired(rules: list[Rule]) -> list[Rule]:
    return [r for r in rules if r.fired]
