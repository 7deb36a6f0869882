"""What the local job adds to Megatron-LM's loop: a step record per iteration (ckptops_records,
the recorder any job can import) and a ``training.checkpoint.saved`` event after each save.

Both hang on the loop's own seams: ``forward_step`` reports each micro-batch it reads, and
Megatron-LM's ``training_log`` (called on every rank after every iteration, with the
iteration's loss, learning rate, grad norm and skipped flag) writes the record; the event
follows ``save_checkpoint``, or with ``--async-save`` the save's finalize step. The batch's
identity is its content: a digest of each sample's tokens, gathered over the data-parallel
ranks in rank order, so another data order or seed is another batch even at the same position.
"""

import base64
import inspect
import json
import math
import os
import time
import urllib.request
import uuid
from datetime import UTC, datetime

import numpy as np
import torch
import xxhash

from ckptops_records import StepRecorder, batch_summary

_state = {"recorder": None, "samples": [], "started": None, "args": None}


def add_arguments(parser):
    group = parser.add_argument_group("ckptops records")
    group.add_argument("--step-records", default=None, help="write one step record (JSON line) per step here")
    group.add_argument("--run-id", default=os.environ.get("CKPTOPS_RUN_ID", "local-tiny"))
    group.add_argument(
        "--attempt-id",
        default=os.environ.get("TORCHELASTIC_RUN_ID")
        or os.environ.get("SLURM_JOB_ID")
        or str(uuid.uuid4())[:8],
    )
    group.add_argument(
        "--notify-url", default=None, help="Prefect API URL: post training.checkpoint.saved after each save"
    )
    group.add_argument("--job-name", default="local-tiny", help="names the event's resource")
    return parser


def start(args) -> None:
    """Hook the loop (before ``pretrain`` runs)."""
    from megatron.training import training

    _state["args"] = args
    if args.rank == args.world_size - 1 and args.step_records:
        flops = training.num_floating_point_operations(args, args.global_batch_size)
        _state["recorder"] = StepRecorder(args.step_records, args.run_id, args.attempt_id, flops)
    original_log = training.training_log
    parameters = inspect.signature(original_log)

    def training_log(*args, **kwargs):
        given = parameters.bind(*args, **kwargs).arguments
        _record(
            given["loss_dict"],
            given["learning_rate"],
            given["iteration"],
            given["skipped_iter"],
            given["grad_norm"],
        )
        return original_log(*args, **kwargs)

    training.training_log = training_log
    if args.notify_url:
        _notify_after_saves(args)


def _notify_after_saves(args) -> None:
    """Post the saved event once the checkpoint is on disk: after ``save_checkpoint`` returns, or
    with ``--async-save`` from the save's own finalize step, after Megatron-LM wrote its tracker
    (the save only scheduled the write)."""
    from megatron.training import checkpointing, training

    original_save = training.save_checkpoint

    def save_checkpoint(iteration, *rest, **kwargs):
        if not args.async_save:
            done = original_save(iteration, *rest, **kwargs)
            if torch.distributed.get_rank() == 0:
                notify_saved(args, iteration)
            return done
        original_schedule = checkpointing.schedule_async_save  # as it is now (faults wrap it too)

        def schedule(request):
            # The request that carries Megatron-LM's finalize steps (a distillation logits saver
            # moves them to a second request, scheduled after the first).
            if torch.distributed.get_rank() == 0 and request.finalize_fns:
                request.add_finalize_fn(lambda: notify_saved(args, iteration))
            return original_schedule(request)

        checkpointing.schedule_async_save = schedule
        try:
            return original_save(iteration, *rest, **kwargs)
        finally:
            checkpointing.schedule_async_save = original_schedule

    training.save_checkpoint = save_checkpoint


def saw_batch(tokens: torch.Tensor) -> None:
    """A micro-batch this rank read: each sample's digest, and the iteration's start time."""
    if _state["started"] is None:
        _state["started"] = time.monotonic()
    for row in tokens.cpu().numpy():
        _state["samples"].append(xxhash.xxh3_64_intdigest(row.tobytes()) >> 1)


def _record(loss_dict, learning_rate, iteration, skipped, grad_norm) -> None:
    from megatron.core import parallel_state

    args = _state["args"]
    seconds = time.monotonic() - _state["started"] if _state["started"] is not None else float("nan")
    mine, _state["samples"], _state["started"] = _state["samples"], [], None
    gathered = [None] * parallel_state.get_data_parallel_world_size()
    torch.distributed.all_gather_object(gathered, mine, group=parallel_state.get_data_parallel_group())
    recorder = _state["recorder"]
    if recorder is None:
        return
    ids = np.array([s for part in gathered for s in part], dtype=np.int64)
    loss = loss_dict.get("lm loss") if loss_dict else None
    loss = float(loss) if loss is not None else float("nan")
    recorder.record(
        iteration=int(iteration),
        consumed_samples=int(args.consumed_train_samples),
        lr=float(learning_rate) if learning_rate is not None else float("nan"),
        batch=batch_summary(args.consumed_train_samples - args.global_batch_size, ids),
        loss=loss,
        grad_norm=float(grad_norm) if grad_norm is not None else None,
        skipped=int(skipped),
        nan=int(not math.isfinite(loss)),
        tokens=args.global_batch_size * args.seq_length,
        step_seconds=seconds,
    )


def finish() -> None:
    if _state["recorder"] is not None:
        _state["recorder"].close()


def notify_saved(args, iteration: int) -> None:
    """Tell Prefect a checkpoint was saved: one plain HTTP POST, so a job needs no Prefect
    installed. Best effort with a short timeout: a down server must never stall training."""
    event = [
        {
            "id": str(uuid.uuid4()),
            "occurred": datetime.now(UTC).isoformat(),
            "event": "training.checkpoint.saved",
            "resource": {"prefect.resource.id": f"ckptops.job.{args.job_name}"},
            "payload": {
                "iteration": iteration,
                "directory": os.path.join(args.save, f"iter_{iteration:07d}"),
            },
        }
    ]
    headers = {"Content-Type": "application/json"}
    # A server with basic auth (production): the same setting Prefect's own clients read.
    auth = os.environ.get("PREFECT_API_AUTH_STRING")
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    request = urllib.request.Request(
        f"{args.notify_url.rstrip('/')}/events",
        data=json.dumps(event).encode(),
        headers=headers,
        method="POST",
    )
    try:
        urllib.request.urlopen(request, timeout=5).close()
    except OSError as e:
        print(f"could not post training.checkpoint.saved to {args.notify_url}: {e}", flush=True)
