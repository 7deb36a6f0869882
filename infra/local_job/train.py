"""The local training job: a real tiny Megatron-Core GPT that saves real torch_dist checkpoints.

Run it with torchrun (gloo on CPU, nccl where CUDA is available):

    torchrun --standalone --nproc_per_node 2 infra/local_job/train.py --save DIR --train-iters 8

It writes Megatron-LM's layout: ``DIR/iter_%07d/`` through ``dist_checkpointing.save`` with the
state Megatron-LM's ``generate_state_dict`` saves (args with consumed_train_samples, iteration,
model, optimizer, opt_param_scheduler, rng_state, num_floating_point_operations_so_far), then
``DIR/latest_checkpointed_iteration.txt``. Its data is synthetic but deterministic: sample ``i``
of the dataset is a function of ``(data_seed, i)`` and the order is Megatron's pretraining
sampler over a seeded permutation, so a resumed run sees exactly the batches it should.
"""

import argparse
import importlib.metadata
import json
import math
import os
import random
import signal
import sys
import time
import urllib.request
import uuid
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_shim  # noqa: E402  (must patch torch before megatron is imported)

cpu_shim.install()

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject  # noqa: E402
from megatron.core.dist_checkpointing.serialization import (  # noqa: E402
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: E402
from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from tasks.resume.records import StepRecorder, batch_summary  # noqa: E402

CHECKPOINT_VERSION = 3.0
TRACKER = "latest_checkpointed_iteration.txt"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save", default=None, help="save directory (Megatron-LM --save)")
    p.add_argument("--load", default=None, help="load from this save directory (Megatron-LM --load)")
    p.add_argument("--ckpt-step", type=int, default=None,
                   help="iteration to load (Megatron-LM --ckpt-step); default: Megatron's tracker")
    p.add_argument("--drill-report", default=None,
                   help="restore drill: load, check what was loaded, write this JSON report, exit")
    p.add_argument("--tensor-sample", type=int, default=8, help="tensors a drill compares with the stored bytes")
    p.add_argument("--no-load-optim", action="store_true", help="Megatron-LM's flag: load neither optimizer nor scheduler")
    p.add_argument("--step-records", default=None, help="write one step record (JSON line) per step here")
    p.add_argument("--run-id", default=os.environ.get("CKPTOPS_RUN_ID", "local-tiny"))
    p.add_argument("--attempt-id", default=os.environ.get("TORCHELASTIC_RUN_ID", str(uuid.uuid4())[:8]))
    # Faults, to rehearse failures and to test that validation catches them.
    p.add_argument("--die-at", default=None, metavar="RANK:ITERATION",
                   help="fault: that rank kills itself with SIGKILL before that iteration")
    p.add_argument("--slow-step-ms", type=float, default=0.0, help="fault: every step takes this much longer")
    p.add_argument("--ballast-mb", type=int, default=0, help="fault: hold this much more memory")
    p.add_argument("--train-iters", type=int, default=8)
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--lr-warmup-samples", type=int, default=16)
    p.add_argument("--lr-decay-samples", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-seed", type=int, default=4321)
    p.add_argument("--dataset-size", type=int, default=100_000)
    p.add_argument("--verify-integrity", action="store_true",
                   help="also write Megatron's integrity.json (sha256 of every file)")
    p.add_argument("--notify-url", default=None,
                   help="Prefect API URL: post training.checkpoint.saved after each save")
    p.add_argument("--job-name", default="local-tiny", help="names the event's resource")
    args = p.parse_args(argv)
    if args.save is None and args.drill_report is None:
        p.error("--save is required (except for a --drill-report run)")
    if args.drill_report and not args.load:
        p.error("--drill-report needs --load")
    return args


# What a drill takes from the checkpoint's own args: the model's shape and the run's schedule.
CHECKPOINT_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                   "micro_batch_size", "global_batch_size", "tensor_model_parallel_size", "lr", "min_lr",
                   "lr_warmup_samples", "lr_decay_samples", "seed", "data_seed", "dataset_size")


def checkpoint_dir(args) -> str:
    step = args.ckpt_step
    if step is None:
        with open(os.path.join(args.load, TRACKER)) as f:
            step = int(f.read().strip())
    return os.path.join(args.load, f"iter_{step:07d}")


def adopt_checkpoint_args(args) -> None:
    """Build the model the checkpoint describes, not the one the command line does. The common
    state is read with ckptops' safe loader (weights_only), before any process group exists."""
    from tasks.checkpoint.dcp import build_index, load_common_state, load_dcp_metadata

    directory = checkpoint_dir(args)
    index = build_index(load_dcp_metadata(Path(directory) / ".metadata"))
    stored = load_common_state(Path(directory), index)["args"]
    for name in CHECKPOINT_ARGS:
        if hasattr(stored, name):
            setattr(args, name, getattr(stored, name))


def init_distributed(args):
    """One process group per job; gloo on CPU, nccl on GPU."""
    # The checkpoint writer otherwise starts a *spawn* Manager on first save (7-14 s here);
    # a fork-context queue created before the process group exists costs well under a second.
    filesystem_async.get_write_results_queue(mp_mode="fork")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group(backend=backend)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size
    )
    args.world_size = torch.distributed.get_world_size()
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    args.pipeline_model_parallel_size = 1
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise SystemExit(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"micro-batch-size x data-parallel size = {per_step}"
        )
    args.num_microbatches = args.global_batch_size // per_step


def set_seeds(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build(args):
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_dtype=torch.float32,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
    )
    if torch.cuda.is_available():
        gpt.cuda()
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=False),
        module=gpt,
    )
    # What Megatron-LM's setup does: without it the schedule never all-reduces the gradients,
    # the data-parallel replicas drift apart, and a checkpoint mixes their tensors.
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=0.01,
                        clip_grad=1.0, use_distributed_optimizer=False),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_samples,
        lr_decay_steps=args.lr_decay_samples,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=args.lr_decay_samples,
        wd_incr_style="constant",
    )
    return config, model, optimizer, scheduler


class SyntheticDataset:
    """Sample ``i`` is an arithmetic token sequence drawn from ``(data_seed, i)``: learnable, and
    identical in every run and on every rank."""

    def __init__(self, args):
        self.args = args
        self.order = np.random.default_rng(args.data_seed).permutation(args.dataset_size)

    def sample_id(self, position):
        return int(self.order[position % self.args.dataset_size])

    def tokens(self, sample_id):
        g = np.random.default_rng([self.args.data_seed, sample_id])
        start, stride = g.integers(0, self.args.vocab_size, size=2)
        steps = np.arange(self.args.seq_length + 1)
        return torch.from_numpy((start + (stride | 1) * steps) % self.args.vocab_size)


def global_batch_ids(args, dataset, consumed):
    """The sample IDs of the whole global batch, in the sampler's order (what every rank's
    sampler sees; each rank then takes its slice of each micro batch)."""
    return [dataset.sample_id(p) for p in range(consumed, consumed + args.global_batch_size)]


def iteration_batches(args, dataset, batch_ids):
    """Megatron's pretraining sampler: each micro batch of ``micro_batch_size x dp`` samples of
    the global batch is split by DP rank."""
    dp_rank = parallel_state.get_data_parallel_rank()
    per_step = args.micro_batch_size * args.data_parallel_size
    for m in range(args.num_microbatches):
        first = m * per_step + dp_rank * args.micro_batch_size
        yield torch.stack([dataset.tokens(i) for i in batch_ids[first:first + args.micro_batch_size]])


def forward_step(causal_mask, data_iterator, model):
    tokens = next(data_iterator)
    if torch.cuda.is_available():
        tokens = tokens.cuda()
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    losses = model(inputs, positions, causal_mask, labels=labels)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    return losses, loss_func


def rng_state_object(args):
    """Megatron-LM's RNG state, a ShardedObject family over the (PP, TP) grid."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    return ShardedObject(
        "rng_state",
        [state],
        (args.pipeline_model_parallel_size, args.tensor_model_parallel_size),
        (pp, tp),
        replica_id=parallel_state.get_data_parallel_rank(),
    )


def saved_args(args, iteration, consumed):
    """The args Megatron-LM stores: the run's settings plus its progress counters."""
    saved = argparse.Namespace(**vars(args))
    saved.iteration = iteration
    saved.consumed_train_samples = consumed
    saved.ckpt_format = "torch_dist"
    return saved


def save_checkpoint(args, model, optimizer, scheduler, iteration, consumed, flops):
    directory = os.path.join(args.save, f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    content_metadata = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        # The installed distribution's version: megatron.core.__version__ appends the git
        # hash of whatever repository the job happens to run in.
        "megatron_core_version": importlib.metadata.version("megatron-core"),
        "torch_version": str(torch.__version__),
    }
    model_sd = model.module.sharded_state_dict()
    state_dict = {
        "args": saved_args(args, iteration, consumed),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, metadata=content_metadata),
        "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": rng_state_object(args),
        "num_floating_point_operations_so_far": flops,
    }
    start = time.perf_counter()
    # Megatron-LM's default (--ckpt-fully-parallel-save): replicated shards are spread over the
    # data-parallel ranks, so every rank writes its own __<rank>_<n>.distcp files.
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
    )
    dist_checkpointing.save(
        state_dict, directory, sharded_strategy=strategy, content_metadata=content_metadata,
        verify_integrity=args.verify_integrity,
    )
    if torch.distributed.get_rank() == 0:
        # Megatron-LM's own tracker, written the way Megatron-LM writes it (plain, not atomic).
        with open(os.path.join(args.save, TRACKER), "w") as f:
            f.write(str(iteration))
        print(f"saved checkpoint iteration {iteration} to {directory} "
              f"in {time.perf_counter() - start:.2f}s", flush=True)
        if args.notify_url:
            notify_saved(args, iteration, directory)
    torch.distributed.barrier()


def load_checkpoint(args, model, optimizer, scheduler):
    """Load model, optimizer, scheduler and RNG as Megatron-LM does; return the progress counters.
    With ``--no-load-optim`` (Megatron-LM's flag) optimizer and scheduler state are not loaded."""
    directory = checkpoint_dir(args)
    content_metadata = dist_checkpointing.load_content_metadata(directory) or {}
    model_sd = model.module.sharded_state_dict()
    sharded = {"model": model_sd, "rng_state": rng_state_object(args)}
    if not args.no_load_optim:
        sharded["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=content_metadata)
    state = dist_checkpointing.load(sharded, directory)
    model.module.load_state_dict(state["model"])
    if not args.no_load_optim:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
    rng = state["rng_state"]
    rng = rng[0] if isinstance(rng, list) else rng
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    torch.cuda.set_rng_state(rng["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])
    return state["iteration"], state["args"].consumed_train_samples, state["num_floating_point_operations_so_far"]


def _sampled(sharded_tensors, k):
    """``k`` sharded tensors spread evenly over the sorted keys (deterministic across runs)."""
    ordered = sorted(sharded_tensors, key=lambda t: (t.key, tuple(t.global_offset)))
    step = max(1, len(ordered) // max(1, k))
    return ordered[::step][:k]


def compare_with_stored(args, model, optimizer):
    """Compare a sample of loaded tensors (model and optimizer state) with the bytes stored in
    the checkpoint, read independently of megatron through ckptops' own record reader."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from tasks.checkpoint.dcp import build_index, load_dcp_metadata, read_record

    directory = Path(checkpoint_dir(args))
    index = build_index(load_dcp_metadata(directory / ".metadata"))
    model_sd = model.module.sharded_state_dict()
    candidates = [t for t in nested_values(model_sd) if isinstance(t, ShardedTensor)]
    candidates += [t for t in nested_values(optimizer.sharded_state_dict(model_sd))
                   if isinstance(t, ShardedTensor)]
    compared, mismatches = [], []
    for sh in _sampled(candidates, args.tensor_sample):
        record = index.records.get((sh.key, tuple(sh.global_offset)))
        if record is None:  # another rank's replica holds it
            continue
        import io
        stored = torch.load(io.BytesIO(read_record(directory, record)), weights_only=True)
        loaded = sh.data.detach().to("cpu").reshape(stored.shape)
        compared.append(record.key)
        if not torch.equal(loaded, stored):
            mismatches.append(record.key)
    return compared, mismatches


def run_drill_load(args, model, optimizer, scheduler):
    """Load the checkpoint for real and report what was loaded (rank 0 writes the report)."""
    start = time.perf_counter()
    iteration, consumed, flops = load_checkpoint(args, model, optimizer, scheduler)
    torch.distributed.barrier()
    load_seconds = time.perf_counter() - start
    compared, mismatches = compare_with_stored(args, model, optimizer)
    if torch.distributed.get_rank() == 0:
        report = {
            "iteration": iteration,
            "consumed_train_samples": consumed,
            "num_floating_point_operations_so_far": flops,
            "scheduler": scheduler.state_dict(),
            "lr": scheduler.get_lr(optimizer.param_groups[0]),
            "load_seconds": load_seconds,
            "world_size": torch.distributed.get_world_size(),
            "tensors_compared": compared,
            "tensor_mismatches": mismatches,
        }
        tmp = f"{args.drill_report}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, args.drill_report)
        print(f"drill: loaded iteration {iteration} in {load_seconds:.2f}s, "
              f"{len(compared)} tensors compared, {len(mismatches)} differ", flush=True)


def notify_saved(args, iteration, directory):
    """Tell Prefect a checkpoint was saved: one plain HTTP POST, so a job needs no Prefect
    installed. Best effort with a short timeout: a down server must never stall training."""
    event = [{
        "id": str(uuid.uuid4()),
        "occurred": datetime.now(timezone.utc).isoformat(),
        "event": "training.checkpoint.saved",
        "resource": {"prefect.resource.id": f"ckptops.job.{args.job_name}"},
        "payload": {"iteration": iteration, "directory": directory},
    }]
    request = urllib.request.Request(
        f"{args.notify_url.rstrip('/')}/events", data=json.dumps(event).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    try:
        urllib.request.urlopen(request, timeout=5).close()
    except OSError as e:
        print(f"could not post training.checkpoint.saved to {args.notify_url}: {e}", flush=True)


def _die_at(args):
    if not args.die_at:
        return None
    rank, iteration = (int(x) for x in args.die_at.split(":"))
    return iteration if rank == torch.distributed.get_rank() else None


def train(args):
    if args.drill_report:
        # A drill builds the model the checkpoint describes; a resumed run, like Megatron-LM,
        # takes its settings from the command line.
        adopt_checkpoint_args(args)
    init_distributed(args)
    set_seeds(args.seed)
    config, model, optimizer, scheduler = build(args)
    if args.drill_report:
        run_drill_load(args, model, optimizer, scheduler)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return
    dataset = SyntheticDataset(args)
    # Megatron's default mask is built on "cuda"; an explicit one works on both devices.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    causal_mask = torch.triu(torch.ones(args.seq_length, args.seq_length, dtype=torch.bool, device=device), 1)
    causal_mask = causal_mask[None, None]
    forward_backward = get_forward_backward_func()
    # Megatron-LM's running total, approximated as 6 x parameters x tokens per iteration.
    parameters = sum(p.numel() for p in model.parameters()) * args.tensor_model_parallel_size
    flops_per_iteration = 6 * parameters * args.global_batch_size * args.seq_length
    iteration, consumed, flops = 0, 0, 0.0
    if args.load:
        iteration, consumed, flops = load_checkpoint(args, model, optimizer, scheduler)
        print(f"resumed from iteration {iteration} after {consumed} samples", flush=True)
    rank0 = torch.distributed.get_rank() == 0
    recorder = StepRecorder(args.step_records if rank0 else None, args.run_id, args.attempt_id, flops_per_iteration)
    # Allocated and touched once: resident for the whole run, as a leak or a bigger buffer would be.
    ballast = torch.ones(args.ballast_mb << 18) if args.ballast_mb else None  # noqa: F841 (float32: 4 bytes each)
    die_before = _die_at(args)
    while iteration < args.train_iters:
        if die_before == iteration + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        batch_ids = global_batch_ids(args, dataset, consumed)
        started = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=partial(forward_step, causal_mask),
            data_iterator=iteration_batches(args, dataset, batch_ids),
            model=model,
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
        )
        updated, grad_norm, _ = optimizer.step()
        scheduler.step(increment=args.global_batch_size)
        # The reported loss is the global batch's: averaged over the data-parallel ranks.
        loss = torch.stack([x["lm loss"] for x in losses]).mean()
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss = loss.item() / args.data_parallel_size
        if args.slow_step_ms:
            time.sleep(args.slow_step_ms / 1000)
        step_seconds = time.perf_counter() - started
        iteration += 1
        lr = scheduler.get_lr(optimizer.param_groups[0])
        recorder.record(iteration=iteration, consumed_samples=consumed + args.global_batch_size, lr=lr,
                        batch=batch_summary(consumed, batch_ids), loss=loss,
                        grad_norm=None if grad_norm is None else float(grad_norm), skipped=0 if updated else 1,
                        nan=int(math.isnan(loss)), tokens=args.global_batch_size * args.seq_length,
                        step_seconds=step_seconds)
        consumed += args.global_batch_size
        flops += flops_per_iteration
        if rank0:
            print(f"iteration {iteration} consumed {consumed} lr {lr:.3e} "
                  f"loss {loss:.6f} grad_norm {grad_norm:.6f}", flush=True)
        if iteration % args.save_interval == 0:
            save_checkpoint(args, model, optimizer, scheduler, iteration, consumed, flops)
    recorder.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    # The guard is load-bearing: megatron's checkpoint writer starts processes that re-import
    # __main__; without it they would re-run the training job and hang the save.
    train(parse_args())
