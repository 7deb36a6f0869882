"""A ``data`` failure: Megatron's rerun state machine reproduced a rejected result on another
GPU, so the data at that position (or the code) is at fault and a relaunch on any nodes fails
again there. The way past is Megatron-LM's ``--iterations-to-skip``: the window (the iteration
the verdict names), the checkpoint to relaunch from (before it, and not one the rerun state
machine saved to rerun that iteration: loading one reruns it and exits), and, once the relaunch
printed its arguments, that Megatron-LM was really told to skip it.
"""

from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.facts import checkpoint_facts
from tasks.checkpoint.signing import Trust
from tasks.errors import CkptopsError
from tasks.recovery.ledger import Incident, Skipped
from tasks.relaunch.printed import PrintedArgs


def rerun_checkpoints(save_dir: Path, iterations: list[int], trust: Trust) -> tuple[int, ...]:
    """Those of ``iterations`` (newest first) passed over: up to the first one saved idle, each
    that Megatron's rerun state machine saved with a rerun pending (a load reruns the iteration
    after it, on its own terms) or whose state cannot be read (chosen from is never guessed)."""
    passed = []
    for i in iterations:
        try:
            pending = checkpoint_facts(save_dir / layout.iter_dir_name(i), trust).rerun_state
        except CkptopsError:
            pending = "unreadable"
        if not pending:
            break
        passed.append(i)
    return tuple(passed)


def carried_skips(earlier: list[Incident], checkpoint: int) -> list[int]:
    """The iterations earlier relaunches skipped (confirmed in Megatron-LM's printed arguments)
    that come after ``checkpoint``: a relaunch from it must pass them again, whatever its own
    failure (the bad data is still there)."""
    return sorted(
        {
            i
            for incident in earlier
            if incident.skipped and incident.skipped["confirmed"]
            for i in incident.skipped["iterations"]
            if i > checkpoint
        }
    )


def skip_plan(save_dir: Path, checkpoint: int, window: list[int], trust: Trust) -> Skipped:
    """What a relaunch from ``checkpoint`` past ``window`` leaves untrained: the iterations, the
    samples in the data order (where they are one range and the batch size does not ramp up:
    not known from the checkpoint alone), the tokens."""
    facts = checkpoint_facts(save_dir / layout.iter_dir_name(checkpoint), trust)
    window = sorted(set(window))
    gbs, first = facts.global_batch_size, window[0]
    samples = None
    if not facts.rampup and window == list(range(first, first + len(window))):
        start = facts.consumed + (first - checkpoint - 1) * gbs
        samples = [start, start + len(window) * gbs]
    tokens = len(window) * gbs * facts.seq_length if facts.seq_length and not facts.rampup else None
    return Skipped(iterations=window, samples=samples, tokens=tokens, confirmed=False)


def skip_not_printed(printed: PrintedArgs, skipped: Skipped) -> str | None:
    """Why the relaunch's printed arguments do not skip the window (None when they do)."""
    told = printed.typed("iterations_to_skip")
    if not isinstance(told, list):
        return (
            f"Megatron-LM printed no iterations_to_skip ({printed.where()}): this version cannot skip "
            f"iterations {skipped['iterations']}"
        )
    missing = [i for i in skipped["iterations"] if i not in told]
    if missing:
        return (
            f"Megatron-LM was not told to skip iterations {missing} (iterations_to_skip {told} at "
            f"{printed.where()}): the job's script does not pass CKPT_ITERATIONS_TO_SKIP or "
            "--iterations-to-skip on to it"
        )
    return None
