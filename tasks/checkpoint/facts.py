"""What a checkpoint says it is: the one place that reads a checkpoint's own state for others.

Resume validation, recovery, goodput and drills ask here (never the common state themselves):
iteration, consumed samples, the scheduler's state and what it counts, the LR schedule's settings
Megatron-LM keeps only in its args, the parallel layout, the writer's versions, and what the
checkpoint's manifest says of it. Read with the safe loader (tasks.checkpoint.dcp), from
Megatron-LM's args or Megatron-Bridge's train_state.pt and run_config.yaml alike
(tasks.checkpoint.dialect).
"""

from dataclasses import dataclass, field
from pathlib import Path

from tasks.checkpoint import dialect, layout
from tasks.checkpoint.dcp import build_index, load_common_state, load_dcp_metadata
from tasks.checkpoint.manifest import UNCHECKED, read_manifest
from tasks.checkpoint.signing import Trust
from tasks.errors import CkptopsError, Malformed, UsageError


def scheduler_unit(
    num_steps, consumed: int | None, iteration: int | None, skipped: int = 0, batch: int = 1
) -> str | None:
    """What a scheduler counts, told by its step count at a checkpoint: Megatron-LM steps it by
    each batch's samples, some loops once per iteration; None if it is neither. Neither steps it
    for the ``skipped`` samples (batches of ``batch``) that --iterations-to-skip passed."""
    if num_steps is None:
        return None
    if consumed is not None and num_steps == consumed - skipped:
        return "samples"
    return "iterations" if iteration is not None and num_steps == iteration - skipped // batch else None


@dataclass
class CheckpointFacts:
    directory: Path
    iteration: int
    consumed: int
    global_batch_size: int
    scheduler: dict
    warmup_init_lr: float
    verified: bool
    # Megatron-LM passes these to the scheduler from its args; its state_dict does not keep them.
    wsd_decay_steps: int | None = None
    wsd_decay_style: str | None = None
    seq_length: int | None = None  # turns samples/s into tokens/s
    not_valid: str | None = None  # what its manifest says, when it says it is not valid
    save_interval: int | None = None  # the job's --save-interval
    layout: dict = field(default_factory=dict)  # tensor, pipeline, data parallel sizes
    data_version: dict | None = None  # what its manifest recorded of the data (batches.data_version)
    # Megatron's rerun state machine's state when it saved, where not idle: a checkpoint it took
    # to rerun an iteration elsewhere (WILL_RERUN_FROM_CHECKPOINT), which reruns on every load
    rerun_state: str | None = None
    rampup: bool = False  # the global batch size ramps up (--rampup-batch-size)
    skipped_samples: int = 0  # samples passed untrained by --iterations-to-skip, up to this save
    written_by: str = dialect.MEGATRON_LM  # or dialect.BRIDGE: which framework's save wrote it

    @property
    def scheduler_unit(self) -> str | None:
        return scheduler_unit(
            self.scheduler.get("num_steps"),
            self.consumed,
            self.iteration,
            self.skipped_samples,
            max(1, self.global_batch_size),
        )


def wsd_decay_steps(args) -> int | None:
    """As Megatron-LM's get_optimizer_param_scheduler computes it (in samples)."""
    if getattr(args, "train_iters", None):
        iters = getattr(args, "lr_wsd_decay_iters", None)
        return None if iters is None else int(iters) * int(args.global_batch_size)
    samples = getattr(args, "lr_wsd_decay_samples", None)
    return None if samples is None else int(samples)


def _manifest_and_common(directory: Path, trust: Trust):
    """The checkpoint's manifest (None if never verified) and its common state, read with the safe
    loader. The manifest first: one whose signature ``trust`` does not accept stops here, before
    any of the checkpoint is loaded."""
    if layout.parse_iter_dir(directory.name) is None or not directory.is_dir():
        raise UsageError(f"{directory}: not a checkpoint directory (expected iter_NNNNNNN)")
    manifest = read_manifest(directory, trust)
    index = build_index(load_dcp_metadata(directory / layout.DCP_METADATA))
    common = load_common_state(directory, index)
    try:
        args = dialect.job_args(directory, common, index)
    except (OSError, ValueError, KeyError, TypeError, CkptopsError) as e:
        what = f"{type(e).__name__}: {e}"
        raise Malformed(f"{directory}: its Megatron-Bridge state is unreadable ({what})") from None
    return manifest, common, args


def saved_args(directory: Path, trust: Trust = UNCHECKED) -> tuple[object, dict]:
    """The job's Megatron-LM arguments as the checkpoint saved them, and the writer's versions
    its manifest recorded (empty if never verified)."""
    directory = Path(directory)
    manifest, _, args = _manifest_and_common(directory, trust)
    if args is None:
        raise UsageError(
            f"{directory}: holds neither Megatron-LM's args nor Megatron-Bridge's train_state.pt"
        )
    return args, (manifest.writer if manifest is not None else {})


def checkpoint_facts(directory: Path, trust: Trust = UNCHECKED) -> CheckpointFacts:
    """What the checkpoint says it is (its own common state, read with the safe loader; its
    manifest read as ``trust`` asks)."""
    directory = Path(directory)
    manifest, common, args = _manifest_and_common(directory, trust)
    try:
        return _facts(directory, manifest, common, args)
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        # The safe loader read it, but it is not the common state Megatron-LM writes.
        raise Malformed(
            f"{directory}: it lacks what Megatron-LM or Megatron-Bridge keeps ({type(e).__name__}: {e})"
        ) from None


def _facts(directory: Path, manifest, common: dict, args) -> CheckpointFacts:
    not_valid = (
        None
        if manifest is None or manifest.valid
        else f"its manifest says {manifest.status}: {manifest.reason}"
    )
    return CheckpointFacts(
        directory,
        int(common["iteration"]),
        int(args.consumed_train_samples),
        int(args.global_batch_size),
        dict(common["opt_param_scheduler"]),
        float(getattr(args, "lr_warmup_init", 0.0) or 0.0),
        manifest is not None and manifest.valid,
        wsd_decay_steps(args),
        getattr(args, "lr_wsd_decay_style", None),
        getattr(args, "seq_length", None),
        not_valid,
        save_interval=getattr(args, "save_interval", None),
        layout={
            "tensor_parallel": getattr(args, "tensor_model_parallel_size", None),
            "pipeline_parallel": getattr(args, "pipeline_model_parallel_size", None),
            "data_parallel": getattr(args, "data_parallel_size", None),
        },
        data_version=manifest.data_version if manifest is not None else None,
        rerun_state=_rerun_state(common.get("rerun_state_machine")),
        rampup=bool(getattr(args, "rampup_batch_size", None)),
        skipped_samples=int(getattr(args, "skipped_train_samples", 0) or 0),
        written_by=getattr(args, "written_by", dialect.MEGATRON_LM),
    )


def _rerun_state(saved) -> str | None:
    state = saved.get("state") if isinstance(saved, dict) else None
    name = getattr(state, "name", None) or (str(state) if state is not None else None)
    return None if name in (None, "NOT_RUNNING_YET", "0") else name
