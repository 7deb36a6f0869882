"""Faults rehearsed inside Megatron-LM's loop, to test that triage, recovery and validation
catch them: each acts in our ``forward_step`` (or on what the loop saves), so the failure comes
out of the real loop and torchrun as it would on a cluster. The texts are the errors CUDA and
PyTorch print for these failures on a GPU; kill, nan and hang are the real thing on any device.
"""

import argparse
import os
import signal
import time

import torch

FAULTS = {
    "kill": "SIGKILL, as the kernel's OOM killer or a lost node ends a process",
    "ecc": "CUDA's uncorrectable ECC error (a GPU memory fault)",
    "oom": "torch's CUDA out-of-memory error",
    "nan": "NaN weights: Megatron's NaN check ends the job on the NaN gradient",
    "hang": "the rank stops answering: the other ranks' collective times out",
}
CUDA_ERROR_TAIL = (
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
    "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)

_settings = argparse.Namespace(fail_at=None, slow_step_ms=0.0, ballast_mb=0)
_done: list[str] = []  # faults that act once and have acted (never written into args: they are saved)
_ballast: list[torch.Tensor] = []


def parse_fault(text: str) -> tuple[int, int, str]:
    rank, iteration, kind = (text.split(":") + ["", ""])[:3]
    if not (rank.isdigit() and iteration.isdigit() and kind in FAULTS):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected RANK:ITERATION:KIND, KIND one of {', '.join(FAULTS)}"
        )
    return int(rank), int(iteration), kind


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("ckptops faults")
    group.add_argument(
        "--fail-at",
        type=parse_fault,
        default=None,
        metavar="RANK:ITERATION:KIND",
        help="before that iteration that rank fails; KIND is one of " + ", ".join(FAULTS),
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


def before_forward(model) -> None:
    """Called before every micro-batch's forward pass (``args.curr_iteration`` is the number of
    iterations done, so the iteration about to run is one more)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args

    if _settings.slow_step_ms:
        time.sleep(_settings.slow_step_ms / 1000 / get_num_microbatches())
    if _settings.fail_at is None:
        return
    rank, iteration, kind = _settings.fail_at
    if torch.distributed.get_rank() == rank and get_args().curr_iteration + 1 == iteration and not _done:
        fail(kind, model)


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
    if kind == "nan":
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(float("nan"))
        _done.append(kind)  # once per iteration's micro-batches, and never again
        return
    while True:  # hang: never reach the next collective
        time.sleep(60)


def _drop_saved_args(names: list[str]) -> None:
    """Megatron-LM saves ``get_args()`` whole in every checkpoint: leave ``names`` out of the
    copy it saves (the running job keeps them)."""
    from megatron.training import checkpointing

    original = checkpointing.generate_state_dict

    def generate_state_dict(args, *rest, **kwargs):
        state = original(args, *rest, **kwargs)
        if "args" in state:
            saved = argparse.Namespace(**vars(state["args"]))
            for name in names:
                if hasattr(saved, name):
                    delattr(saved, name)
            state["args"] = saved
        return state

    checkpointing.generate_state_dict = generate_state_dict
