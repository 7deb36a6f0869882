"""Faults rehearsed inside Megatron-LM's loop, to test that triage, recovery and validation
catch them: each acts in our ``forward_step`` (or on what the loop saves), so the failure comes
out of the real loop and torchrun as it would on a cluster. The texts are the errors CUDA and
PyTorch print for these failures on a GPU; kill, nan and hang are the real thing on any device.
"""

import argparse
import copy
import os
import signal
import time

import torch

FAULTS = {
    "kill": "SIGKILL, as the kernel's OOM killer or a lost node ends a process",
    "ecc": "CUDA's uncorrectable ECC error (a GPU memory fault)",
    "oom": "torch's CUDA out-of-memory error",
    "nan": "NaN weights: Megatron's NaN check ends the job on the NaN gradient",
    "nan-once": "one NaN loss, once: a rerun of the iteration is clean (a transient GPU fault)",
    "nan-data": "a NaN loss at that iteration on every attempt, on any GPU, as a bad sample gives: "
    "the rerun reproduces it, and only skipping the iteration gets past it",
    "hang": "the rank stops answering: the other ranks' collective times out",
}
# Faults in what one save writes (the running job keeps its healthy state): each was reported
# from the field with every CRC valid. KIND at ITERATION acts on that iteration's save only.
SAVE_FAULTS = {
    "nan-weight": "one element of one model weight is NaN (nvidia-resiliency-ext #349)",
    "inf-exp-avg": "one element of Adam's first moment is +Inf",
    "negative-exp-avg-sq": "one element of Adam's second moment is negative",
    "stale": "every tensor as the previous save wrote it (NVIDIA-NeMo/RL #3312)",
    "step-ahead": "the optimizer's step counters one ahead of the iteration (NVRx PR #376)",
    "drop-tensor": "one model tensor left out of the save and its .metadata (Megatron-LM #4378)",
    "spike": "one model weight 100 times larger (a loss spike's start: a warning, not a fault)",
    "lr-schedule": "the LR scheduler's decay horizon halved: every file whole and consistent, but "
    "a job that loads the scheduler's own values (--use-checkpoint-opt_param-scheduler) resumes "
    "on another learning rate",
}
# Faults in the save itself, on the store: what a save that stalls or fails half-way leaves
# behind. KIND at ITERATION acts on that iteration's save only (the store full is no fault of
# ours: the tests save into a size-limited tmpfs, and ENOSPC is the kernel's).
BROKEN_SAVES = {
    "kill-writer": "with --async-save, rank 1's async checkpoint worker is SIGKILLed as the save is "
    "handed to it: its peers wait in finalization (Megatron-LM #6970)",
    "kill-before-tracker": "rank 0 is SIGKILLed once every shard and the metadata are written, before "
    "it writes the tracker (a synchronous save)",
    "tracker-first": "rank 0 writes the tracker naming the save before its data (Megatron-Bridge "
    "PR #5746), and rank 1 dies before writing its shard",
}
CUDA_ERROR_TAIL = (
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
    "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)

_settings = argparse.Namespace(fail_at=None, slow_step_ms=0.0, ballast_mb=0)
_done: list[str] = []  # faults that act once and have acted (never written into args: they are saved)
_ballast: list[torch.Tensor] = []
_started: dict[str, int] = {}  # the iterations done when this run first trained
_spoil: list[bool] = []  # the next forward's output is made NaN (nan-once, nan-data)


def parse_fault(text: str) -> tuple[int, int, str, bool]:
    """RANK:ITERATION:KIND; ITERATION ``+N``: N iterations after the one the run started from (a
    relaunch's loaded checkpoint), as a checkpoint that goes bad soon after every load does."""
    rank, iteration, kind = (text.split(":") + ["", ""])[:3]
    relative = iteration.startswith("+")
    if not (rank.isdigit() and iteration.removeprefix("+").isdigit() and kind in FAULTS):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected RANK:ITERATION:KIND (ITERATION or +N after the start), KIND one of "
            f"{', '.join(FAULTS)}"
        )
    return int(rank), int(iteration.removeprefix("+")), kind, relative


def _iteration_and_kind(text: str, kinds: dict[str, str]) -> tuple[int, str]:
    iteration, _, kind = text.partition(":")
    if not (iteration.isdigit() and kind in kinds):
        raise argparse.ArgumentTypeError(f"{text!r}: expected ITERATION:KIND, KIND one of {', '.join(kinds)}")
    return int(iteration), kind


def parse_save_fault(text: str) -> tuple[int, str]:
    return _iteration_and_kind(text, SAVE_FAULTS)


def parse_broken_save(text: str) -> tuple[int, str]:
    return _iteration_and_kind(text, BROKEN_SAVES)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("ckptops faults")
    group.add_argument(
        "--fail-at",
        type=parse_fault,
        default=None,
        metavar="RANK:ITERATION:KIND",
        help="before that iteration (+N: N after the one the run started from) that rank fails; KIND "
        "is one of " + ", ".join(FAULTS),
    )
    group.add_argument(
        "--corrupt-save",
        type=parse_save_fault,
        action="append",
        default=[],
        metavar="ITERATION:KIND",
        help="the save of that iteration writes a wrong state; KIND is one of " + ", ".join(SAVE_FAULTS),
    )
    group.add_argument(
        "--break-save",
        type=parse_broken_save,
        action="append",
        default=[],
        metavar="ITERATION:KIND",
        help="the save of that iteration breaks on the store; KIND is one of " + ", ".join(BROKEN_SAVES),
    )
    group.add_argument("--slow-step-ms", type=float, default=0.0, help="every step takes this much longer")
    group.add_argument("--ballast-mb", type=int, default=0, help="hold this much more memory")
    group.add_argument(
        "--drop-saved-arg",
        action="append",
        default=[],
        metavar="NAME",
        help="save the args without NAME, like a job whose Megatron-LM never set it",
    )
    return parser


def start(args) -> None:
    global _settings
    _settings = args
    if args.ballast_mb:
        _ballast.append(torch.ones(args.ballast_mb << 18, dtype=torch.float32))
    if args.drop_saved_arg:
        _drop_saved_args(args.drop_saved_arg)
    if args.corrupt_save:
        _change_saved_state(_SaveCorrupter(dict(args.corrupt_save)))
    if args.break_save:
        _break_saves(dict(args.break_save), args.save)


def before_forward(model) -> None:
    """Called before every micro-batch's forward pass (``args.curr_iteration`` is the number of
    iterations done, so the iteration about to run is one more)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args

    if _settings.slow_step_ms:
        time.sleep(_settings.slow_step_ms / 1000 / get_num_microbatches())
    if _settings.fail_at is None:
        return
    rank, iteration, kind, relative = _settings.fail_at
    done = get_args().curr_iteration
    _started.setdefault("iteration", done)  # the first forward: the iteration the run loaded
    if relative:
        iteration += _started["iteration"]
    if torch.distributed.get_rank() == rank and done + 1 == iteration and not _done:
        fail(kind, model)


def after_forward(output: torch.Tensor) -> torch.Tensor:
    """The forward's output, NaN once where a nan-once fault asked: the weights stay whole."""
    if _spoil:
        _spoil.clear()
        return output * float("nan")
    return output


def fail(kind: str, model) -> None:
    """Fail this rank the way ``kind`` says (see FAULTS)."""
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "ecc":
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered\n" + CUDA_ERROR_TAIL)
    if kind == "oom":
        device = int(os.environ.get("LOCAL_RANK", 0))
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate 2.00 GiB. GPU {device} has a total capacity of "
            "79.11 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has "
            "78.08 GiB memory in use. Of the allocated memory 75.12 GiB is allocated by PyTorch, and "
            "1.43 GiB is reserved by PyTorch but unallocated."
        )
    if kind == "nan-once":
        _done.append(kind)  # after_forward spoils this forward's output; the rerun's is clean
        _spoil.append(True)
        return
    if kind == "nan-data":
        _spoil.append(True)  # this forward and every rerun of it, in this run and any relaunch
        return
    if kind == "nan":
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(float("nan"))
        _done.append(kind)  # once per iteration's micro-batches, and never again
        return
    while True:  # hang: never reach the next collective
        time.sleep(60)


def _change_saved_state(change) -> None:
    """Call ``change(state, iteration)`` on every state dict Megatron-LM's checkpointing builds
    (``iteration`` is None when it builds one to load into), just before it is saved."""
    from megatron.training import checkpointing

    original = checkpointing.generate_state_dict

    def generate_state_dict(*args, **kwargs):
        state = original(*args, **kwargs)
        change(state, kwargs.get("iteration"))
        return state

    checkpointing.generate_state_dict = generate_state_dict


def _break_saves(faults: dict[int, str], save_dir: str) -> None:
    """Break the saves of ``faults``' iterations as BROKEN_SAVES says, around Megatron-LM's own
    save: its ``save_checkpoint``, the tracker's file name (asked for once the data of a
    synchronous save are written) and the hand-over of an async save to its worker."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
    from megatron.training import checkpointing, training

    original_save = training.save_checkpoint
    original_tracker = checkpointing.get_checkpoint_tracker_filename
    original_schedule = checkpointing.schedule_async_save
    saving: list[str] = []  # the kind of the save under way

    def save_checkpoint(iteration, *rest, **kwargs):
        kind, rank = faults.get(iteration), torch.distributed.get_rank()
        if kind == "tracker-first" and rank == 0:
            with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as tracker:
                tracker.write(str(iteration))
        if kind == "tracker-first" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        saving[:] = [kind]
        try:
            return original_save(iteration, *rest, **kwargs)
        finally:
            saving.clear()

    def tracker_filename(path):
        if saving == ["kill-before-tracker"] and torch.distributed.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return original_tracker(path)

    def schedule(request):
        # Killed as the save is handed over, not after: a worker that got the request first may
        # write its shard in the moment before the kill lands, and then nothing is missing. The
        # saves before it are finished first, on every rank (Megatron-LM queues a save behind an
        # unfinished one): the fault breaks this save alone, however slow the machine.
        if saving == ["kill-writer"]:
            from megatron.training.async_utils import maybe_finalize_async_save

            maybe_finalize_async_save(blocking=True)
            worker = PersistentAsyncCaller._persistent_process
            if torch.distributed.get_rank() == 1 and worker is not None:
                os.kill(worker.pid, signal.SIGKILL)
                worker.join(timeout=10)
        return original_schedule(request)

    training.save_checkpoint = save_checkpoint
    checkpointing.get_checkpoint_tracker_filename = tracker_filename
    checkpointing.schedule_async_save = schedule


def _drop_saved_args(names: list[str]) -> None:
    """Megatron-LM saves ``get_args()`` whole in every checkpoint: leave ``names`` out of the
    copy it saves (the running job keeps them)."""

    def drop(state, _iteration):
        if "args" in state:
            saved = argparse.Namespace(**vars(state["args"]))
            for name in names:
                if hasattr(saved, name):
                    delattr(saved, name)
            state["args"] = saved

    _change_saved_state(drop)


class _SaveCorrupter:
    """Changes what the saves of ``faults``' iterations write, just before Megatron-LM saves it:
    tensors are replaced by changed copies, never changed in place, so training goes on as it
    was. A load (no iteration given) is left alone."""

    def __init__(self, faults: dict[int, str]):
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        self.faults, self.tensor, self.object = faults, ShardedTensor, ShardedObject
        self.written: dict = {}  # the previous save's tensors, for a stale re-save

    def __call__(self, state: dict, iteration: int | None) -> None:
        if iteration is None:
            return
        if iteration in self.faults:
            self._corrupt(state, self.faults[iteration])
        self.written = {
            self._identity(value): value.data.detach().clone()
            for _, _, value in self._leaves(state)
            if isinstance(value, self.tensor)
        }

    def _corrupt(self, state: dict, kind: str) -> None:
        model = lambda s: s.data.is_floating_point() and not s.key.startswith("optimizer.")  # noqa: E731
        if kind == "nan-weight":
            self._set_element(state["model"], model, float("nan"))
        elif kind == "inf-exp-avg":
            exp_avg = lambda s: ".exp_avg" in s.key and "exp_avg_sq" not in s.key  # noqa: E731
            self._set_element(state["optimizer"], exp_avg, float("inf"))
        elif kind == "negative-exp-avg-sq":
            self._set_element(state["optimizer"], lambda s: "exp_avg_sq" in s.key, -1e-3)
        elif kind == "step-ahead":
            state["optimizer"] = self._bump_steps(state["optimizer"])
        elif kind == "spike":
            weight = lambda s: model(s) and s.key.endswith("weight")  # noqa: E731
            container, key, sharded = self._first(state["model"], weight)
            self._replace(container, key, sharded, sharded.data.detach() * 100)
        elif kind == "lr-schedule":
            scheduler = state["opt_param_scheduler"]
            state["opt_param_scheduler"] = {**scheduler, "lr_decay_steps": scheduler["lr_decay_steps"] // 2}
        elif kind == "drop-tensor":
            leaves = self._leaves(state["model"])
            last = max(v.key for _, _, v in leaves if isinstance(v, self.tensor) and model(v))
            for container, key, value in list(self._leaves(state["model"])):
                if isinstance(value, self.tensor) and value.key == last:
                    del container[key]
        elif kind == "stale":
            for container, key, value in list(self._leaves(state)):
                if isinstance(value, self.tensor) and self._identity(value) in self.written:
                    self._replace(container, key, value, self.written[self._identity(value)])

    def _leaves(self, container):
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in list(items):
            if isinstance(value, (dict, list)):
                yield from self._leaves(value)
            else:
                yield container, key, value

    @staticmethod
    def _identity(sharded) -> tuple:
        return sharded.key, tuple(sharded.global_offset), str(sharded.flattened_range)

    @staticmethod
    def _replace(container, key, sharded, data) -> None:
        changed = copy.copy(sharded)
        changed.data = data
        container[key] = changed

    def _first(self, state, wanted) -> tuple:
        return next((c, k, v) for c, k, v in self._leaves(state) if isinstance(v, self.tensor) and wanted(v))

    def _set_element(self, state, wanted, value) -> None:
        container, key, sharded = self._first(state, wanted)
        data = sharded.data.detach().clone()
        data.view(-1)[0] = value
        self._replace(container, key, sharded, data)

    def _bump_steps(self, value):
        if isinstance(value, self.object):
            changed = copy.copy(value)
            changed.data = self._bump_steps(value.data)
            return changed
        if isinstance(value, dict):
            counter = lambda k, v: k in ("step", "common_step") and isinstance(v, (int, float, torch.Tensor))  # noqa: E731
            return {k: v + 1 if counter(k, v) else self._bump_steps(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._bump_steps(v) for v in value]
        return value
