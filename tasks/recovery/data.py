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
from tasks.recovery.ledger import Skipped
from tasks.relaunch.printed import PrintedArgs


def rerun_checkpoints(save_dir: Path, iterations: list[int], trust: Trust) -> tuple[int, ...]:
    """Those of ``iterations`` whose checkpoint Megatron's rerun state machine saved with a rerun
    pending (its state is not idle): a load reruns the iteration after it, on its own terms."""
    return tuple(
        i for i in iterations if checkpoint_facts(save_dir / layout.iter_dir_name(i), trust).rerun_state
    )


def skip_plan(save_dir: Path, checkpoint: int, window: list[int], trust: Trust) -> Skipped:
    """What a relaunch from ``checkpoint`` past ``window`` leaves untrained: the iterations, the
    samples in the data order (none where the batch size ramps up: not known from the
    checkpoint alone), the tokens."""
    facts = checkpoint_facts(save_dir / layout.iter_dir_name(checkpoint), trust)
    gbs, first = facts.global_batch_size, min(window)
    samples = None
    if not facts.rampup:
        start = facts.consumed + (first - checkpoint - 1) * gbs
        samples = [start, start + len(window) * gbs]
    tokens = len(window) * gbs * facts.seq_length if facts.seq_length and not facts.rampup else None
    return Skipped(iterations=sorted(window), samples=samples, tokens=tokens)


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
