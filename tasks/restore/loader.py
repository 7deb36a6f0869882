"""The restore drill's loader: rebuild a job's model and optimizer, load a checkpoint into them for
real, and check on every rank what was loaded.

    torchrun --nproc_per_node N -m tasks.restore.loader --checkpoint DIR --report FILE
    srun --ntasks-per-node 8 python -m tasks.restore.loader ...      (MASTER_ADDR/PORT set)

The model comes from the checkpoint (its args, settled against its tensor shapes: see
``model_args``) or from the job's own provider (``--model-provider package.module:function``);
it is laid out on the drill's TP and PP (default: the checkpoint's), and dist_checkpointing
reshards onto it. The distributed optimizer's gradient buffers (their dtype and buckets) are
rebuilt as the checkpoint's keys name them (``buffers``), whatever the args say. What
Megatron-LM itself refuses is refused here too, with its reason: RNG state is not loaded across
a TP/PP change, and a distributed optimizer saved bucket by bucket (``dp_reshardable``) cannot be
loaded on another TP or PP. A key the rebuilt model asks for and the checkpoint lacks is one
line naming the first.

After the load, every rank compares a sample of its own tensors (model and optimizer state)
with the stored bytes; rank 0 gathers them into one ``LoadReport``. A rank that fails writes its
own first error beside the report, because torchrun and srun only say that a rank exited.

``load_state`` is also the local training job's ``--load``: one loader for drills and resumes.
"""

import argparse
import os
import random
import re
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from tasks.restore import cpu

cpu.install()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.dist_checkpointing.mapping import (  # noqa: E402
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    apply_factories,
)
from megatron.core.dist_checkpointing.validation import StrictHandling  # noqa: E402

from tasks.checkpoint import dialect  # noqa: E402
from tasks.checkpoint import layout as ckpt_layout  # noqa: E402
from tasks.checkpoint.dcp import build_index, load_common_state, load_dcp_metadata  # noqa: E402
from tasks.checkpoint.facts import wsd_decay_steps  # noqa: E402
from tasks.checkpoint.schedule import ScheduleError, scheduler_from_state  # noqa: E402
from tasks.errors import CkptopsError, UsageError  # noqa: E402
from tasks.restore import buffers, param_groups  # noqa: E402
from tasks.restore import build as builder  # noqa: E402
from tasks.restore.compare import compare, sample  # noqa: E402
from tasks.restore.model_args import ModelArgsError, resolve  # noqa: E402
from tasks.restore.report import LoadReport, RankCheck, write_error, write_report  # noqa: E402

RESHARDABLE_FORMATS = {"fully_reshardable", "fully_sharded_model_space"}


class LayoutError(CkptopsError):
    """The checkpoint cannot be loaded on the requested layout (Megatron-LM refuses it too)."""


class KeyMismatch(CkptopsError):
    """The rebuilt model or optimizer asks for keys the checkpoint does not hold: one line, the
    first of them (megatron's own error lists every key of the checkpoint)."""

    def __init__(self, keys, held: str = ""):
        self.keys = sorted(keys)
        more = f" (and {len(self.keys) - 1} more on this rank)" if len(self.keys) > 1 else ""
        where = f"; the checkpoint holds {held}" if held else ""
        asked = "the rebuilt model and optimizer ask for it"
        super().__init__(f"{self.keys[0]}: not in the checkpoint, and {asked}{more}{where}")


def _held(key: str, saved: dict) -> str:
    """What the checkpoint holds for the data-parallel group of a distributed optimizer's bucket key."""
    match = re.match(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_", key)
    if match is None:
        return ""
    held = saved.get(int(match[1]), [])
    return "; ".join(b.describe() for b in held) or f"no buckets for dp_group_idx_{match[1]}"


def rng_state_object(args) -> ShardedObject:
    """Megatron-LM's RNG state, a ShardedObject family over the (PP, TP) grid."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    pp, tp = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    return ShardedObject(
        "rng_state",
        [state],
        (args.pipeline_model_parallel_size, args.tensor_model_parallel_size),
        (pp, tp),
        replica_id=parallel_state.get_data_parallel_rank(),
    )


def _set_rng(rng) -> None:
    rng = rng[0] if isinstance(rng, list) else rng
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    torch.cuda.set_rng_state(rng["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])


def content_metadata(directory: Path) -> dict:
    return dict(dist_checkpointing.load_content_metadata(str(directory)) or {})


def optimizer_format(args, metadata: dict) -> str | None:
    """The distributed optimizer's sharding type, as Megatron-LM decides it on load."""
    if not args.use_distributed_optimizer:
        return None
    return metadata.get("distrib_optim_sharding_type") or (
        "fully_sharded_model_space"
        if getattr(args, "ckpt_fully_parallel_save", False)
        else "dp_zero_gather_scatter"
    )


@dataclass
class Loaded:
    iteration: int
    consumed_train_samples: int
    num_floating_point_operations_so_far: float
    scheduler_state: dict | None
    notes: list[str]  # the saved param-group values the args did not imply
    skipped_train_samples: int = 0  # passed untrained by --iterations-to-skip


def load_state(
    directory: Path,
    built: builder.Built,
    args,
    load_optim: bool,
    load_rng: bool,
    scheduler=None,
) -> Loaded:
    """Load model, optimizer, scheduler and RNG state from ``directory`` into what ``built`` holds,
    as Megatron-LM's ``load_checkpoint`` does for a ``torch_dist`` checkpoint. The optimizer's
    param groups are the saved ones (``param_groups.adopt``), whatever the args imply. A key the
    checkpoint lacks is ``KeyMismatch`` naming the first (megatron's own strict check against the
    checkpoint's metadata; the keys it does hold are loaded first, and nothing is applied)."""
    metadata = content_metadata(directory)
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    model_sd = built.module.sharded_state_dict(metadata=metadata)
    sharded = {"model": model_sd}
    if load_rng:
        sharded["rng_state"] = rng_state_object(args)
    optimizer = built.optimizer
    if load_optim:
        _allocate_optimizer_state(optimizer, args.use_distributed_optimizer)
        sharded["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)
    state, _, unexpected = dist_checkpointing.load(
        sharded, str(directory), strict=StrictHandling.RETURN_UNEXPECTED
    )
    if unexpected:
        raise KeyMismatch(unexpected)
    built.module.load_state_dict(state["model"])
    notes = []
    if load_optim:
        notes = param_groups.adopt(_inner(optimizer), state["optimizer"], args)
        if args.use_distributed_optimizer:
            # torch Adam keeps a per-parameter "step" tensor that no sharding format saves (and
            # the fully reshardable loader would look for): set from the loaded group's step.
            for inner in _inner(optimizer):
                for param_state in inner.optimizer.state.values():
                    param_state.pop("step", None)
        with torch.no_grad():
            optimizer.load_state_dict(state["optimizer"])
        if args.use_distributed_optimizer:
            _restore_adam_steps(optimizer)
        if scheduler is not None:
            scheduler.load_state_dict(state["opt_param_scheduler"])
    if load_rng:
        _set_rng(state["rng_state"])
    saved = dialect.job_args(directory, state)  # Megatron-LM's args, or Bridge's train_state.pt
    flops = state.get("num_floating_point_operations_so_far") or getattr(
        saved, "floating_point_operations", 0
    )
    return Loaded(
        int(state["iteration"]),
        int(saved.consumed_train_samples),
        float(flops or 0.0),
        state.get("opt_param_scheduler"),
        notes,
        int(getattr(saved, "skipped_train_samples", 0) or 0),
    )


def _allocate_optimizer_state(optimizer, distributed: bool) -> None:
    """torch Adam creates its state lazily, at its first step: give it state to load into.

    Megatron fills it with zeros (``init_state_fn``), or for the distributed optimizer runs a whole
    Adam step on zero gradients: both write every byte of the state, which the load then writes
    again (on a CPU drill, two thirds of the load's time went there). The same tensors allocated
    empty are only written once, by the load. Any other optimizer gets megatron's own way.
    """
    for inner in _inner(optimizer):
        torch_optimizer = inner.optimizer
        adam = isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW) and not any(
            group.get("amsgrad") for group in torch_optimizer.param_groups
        )
        if not adam:
            if distributed:
                inner._init_optimizer_states_with_dummy_values()
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if not state and param.numel():
                    state["exp_avg"] = torch.empty_like(param)
                    state["exp_avg_sq"] = torch.empty_like(param)
                    if distributed:  # the distributed optimizer's state_dict() reads it
                        state["step"] = torch.tensor(0.0)


def _inner(optimizer) -> list:
    """The optimizers megatron chains (one per parameter kind), or the one itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _restore_adam_steps(optimizer) -> None:
    """Bucket-wise formats do not save torch Adam's per-parameter ``step``; the group's ``step``
    is the one that was saved. A shared tensor would be incremented once per parameter."""
    for inner in _inner(optimizer):
        torch_optimizer = inner.optimizer
        for group in torch_optimizer.param_groups:
            step = group.get("step")
            if step is None:
                continue
            for param in group["params"]:
                state = torch_optimizer.state.get(param)
                if state is not None:
                    state["step"] = torch.tensor(float(step), dtype=torch.float32)


def _tensors(state) -> list[ShardedTensor]:
    """The ShardedTensors of a sharded state dict, except the distributed optimizer's padding
    between parameters in a bucket: it is saved from uninitialised memory and holds no state."""
    if isinstance(state, ShardedTensor):
        return [state]
    if isinstance(state, dict):
        padding = state.get("padding")
        if isinstance(padding, LocalNonpersistentObject) and padding.unwrap() is True:
            return []
        return [t for value in state.values() for t in _tensors(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in _tensors(value)]
    return []


def _picked(built: builder.Built, load_optim: bool, metadata: dict, k: int) -> list[ShardedTensor]:
    """``k`` of this rank's tensors as the checkpoint names them: half model weights, half
    optimizer state (the optimizer's are derived from the model's before megatron's factories
    are applied)."""
    model_sd = built.module.sharded_state_dict(metadata=metadata)
    optim_sd = (
        built.optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)
        if load_optim
        else {}
    )
    apply_factories(model_sd)
    apply_factories(optim_sd)
    model, optim = _tensors(model_sd), _tensors(optim_sd)
    from_optim = min(len(optim), k // 2)
    return sample(model, k - from_optim) + sample(optim, from_optim)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, type=Path, help="the iter_NNNNNNN directory to load")
    p.add_argument("--report", required=True, type=Path, help="where rank 0 writes the load report (JSON)")
    p.add_argument(
        "--tensor-sample", type=int, default=8, help="tensors each rank compares with the stored bytes"
    )
    p.add_argument(
        "--tensor-parallel", type=int, default=None, help="TP of the drill [default: the checkpoint's]"
    )
    p.add_argument(
        "--pipeline-parallel", type=int, default=None, help="PP of the drill [default: the checkpoint's]"
    )
    p.add_argument("--model-provider", default=None, help="package.module:function building the job's model")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="load this many times into the same process (the "
        "later loads show what page faults and first-touch allocation cost the first)",
    )
    return p.parse_args(argv)


class _Load:
    """One rank's part of a drill's load: build the model, load the checkpoint into it and compare."""

    def __init__(self, options):
        self.options = options
        self.report = LoadReport()
        directory = options.checkpoint
        self.index = build_index(load_dcp_metadata(directory / ckpt_layout.DCP_METADATA))
        common = load_common_state(directory, self.index)
        stored = dialect.job_args(directory, common, self.index)
        if options.model_provider:
            if stored is None:
                raise ModelArgsError(f"{directory.name}: no args in the common state for the model provider")
            self.args, self.provider = stored, builder.import_provider(options.model_provider)
            self.report.model = options.model_provider
        else:
            resolved = resolve(stored, self.index.tensors)
            self.args, self.provider = resolved.args, None
            self.report.inferred = resolved.inferred
        self.report.checkpoint_layout = {
            "tensor_parallel": self.args.tensor_model_parallel_size,
            "pipeline_parallel": self.args.pipeline_model_parallel_size,
            "data_parallel": getattr(self.args, "data_parallel_size", None),
        }
        self.scheduler_state = common.get("opt_param_scheduler")

    def run(self) -> None:
        """Lay the model out on the drill's layout, load into it, compare each rank's sample with
        the stored bytes, and report (rank 0)."""
        same_tp_pp = self._lay_out()
        metadata = content_metadata(self.options.checkpoint)
        load_optim = not self.args.no_save_optim
        self.report.optimizer_format = optimizer_format(self.args, metadata)
        if load_optim and not same_tp_pp and self.report.optimizer_format not in (None, *RESHARDABLE_FORMATS):
            raise LayoutError(self._unreshardable())
        load_rng = same_tp_pp and not self.args.no_save_rng
        if not same_tp_pp:
            self.report.notes.append("RNG state not loaded: the TP/PP layout changed (as Megatron-LM does)")
        builder.set_seeds(int(getattr(self.args, "seed", 1234)))
        self.saved_buffers = buffers.saved_buffers(self.index.tensors) if load_optim else {}
        built = builder.build(self.args, self.provider, initialize=False, saved_buffers=self.saved_buffers)
        self.report.notes.extend(built.notes)
        scheduler = self._scheduler(built) if load_optim and self.scheduler_state else None
        loaded = self._load(built, load_optim, load_rng, scheduler)
        if scheduler is not None:
            self.report.scheduler = scheduler.state_dict()
            self.report.lr = scheduler.get_lr(built.optimizer.param_groups[0])
        metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self._compare_and_report(_picked(built, load_optim, metadata, self.options.tensor_sample), loaded)

    def _lay_out(self) -> bool:
        """TP and PP as the drill asks (default: the checkpoint's), the process groups made;
        whether the layout is the checkpoint's own."""
        options, args = self.options, self.args
        same_tp_pp = (
            (options.tensor_parallel or args.tensor_model_parallel_size),
            (options.pipeline_parallel or args.pipeline_model_parallel_size),
        ) == (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        args.tensor_model_parallel_size = options.tensor_parallel or args.tensor_model_parallel_size
        args.pipeline_model_parallel_size = options.pipeline_parallel or args.pipeline_model_parallel_size
        builder.init_distributed(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        self.report.world_size = torch.distributed.get_world_size()
        self.report.layout = {
            "tensor_parallel": args.tensor_model_parallel_size,
            "pipeline_parallel": args.pipeline_model_parallel_size,
            "data_parallel": parallel_state.get_data_parallel_world_size(),
        }
        return same_tp_pp

    def _unreshardable(self) -> str:
        saved = self.report.checkpoint_layout
        return (
            f"optimizer state saved as {self.report.optimizer_format!r} cannot be loaded on TP "
            f"{self.args.tensor_model_parallel_size} x PP {self.args.pipeline_model_parallel_size} "
            f"(the checkpoint's is TP {saved['tensor_parallel']} x PP {saved['pipeline_parallel']}); "
            "Megatron-LM refuses this too: drill on "
            "the checkpoint's TP and PP, or save with --dist-ckpt-optim-fully-reshardable"
        )

    def _scheduler(self, built):
        args = self.args
        try:
            return scheduler_from_state(
                built.optimizer,
                self.scheduler_state,
                float(getattr(args, "lr_warmup_init", 0.0) or 0.0),
                wsd_decay_steps(args),
                getattr(args, "lr_wsd_decay_style", None),
            )
        except ScheduleError as e:
            raise ScheduleError(f"{self.options.checkpoint.name}: {e}") from None

    def _load(self, built, load_optim: bool, load_rng: bool, scheduler):
        """Megatron's load into the built model and optimizer (``--repeat`` times, each timed)."""
        timings = []
        for _ in range(max(1, self.options.repeat)):
            torch.distributed.barrier()
            started = time.perf_counter()
            try:
                loaded = load_state(
                    self.options.checkpoint, built, self.args, load_optim, load_rng, scheduler
                )
            except KeyMismatch as e:
                raise KeyMismatch(e.keys, _held(e.keys[0], self.saved_buffers)) from None
            torch.distributed.barrier()
            timings.append(time.perf_counter() - started)
        self.report.load_seconds, self.report.repeat_load_seconds = timings[0], timings[1:]
        self.report.iteration, self.report.consumed_train_samples = (
            loaded.iteration,
            loaded.consumed_train_samples,
        )
        self.report.skipped_train_samples = loaded.skipped_train_samples
        self.report.optimizer_loaded, self.report.rng_loaded = load_optim, load_rng
        self.report.notes.extend(loaded.notes)
        return loaded

    def _compare_and_report(self, picked, loaded) -> None:
        compared, mismatches = compare(self.options.checkpoint, self.index, picked)
        world = self.report.world_size
        checks = [None] * world
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        torch.distributed.all_gather_object(
            checks, RankCheck(torch.distributed.get_rank(), compared, mismatches, node)
        )
        if torch.distributed.get_rank() == 0:
            self.report.ranks = checks
            write_report(self.options.report, self.report)
            print(
                f"drill: loaded iteration {loaded.iteration} in {self.report.load_seconds:.2f}s on {world} "
                f"ranks, {self.report.compared} tensors compared, {len(self.report.mismatches)} differ",
                flush=True,
            )
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def one_line(error: BaseException) -> str:
    """The error as one line: ours as they are; DCP's CheckpointException by the first rank's
    own failure (its message is a summary with tracebacks)."""
    if isinstance(error, CkptopsError):
        return str(error)
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))
        if isinstance(error, tuple):  # (exception, traceback) in some torch versions
            error = error[0]
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def main(argv=None) -> int:
    options = parse_args(argv)
    try:
        _Load(options).run()
        return 0
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        write_error(options.report, _rank(), one_line(e), isinstance(e, UsageError))
        traceback.print_exc()
        return 2 if isinstance(e, UsageError) else 1


if __name__ == "__main__":
    sys.exit(main())
