"""A training loop of our own over Megatron-Core, not Megatron-LM's ``pretrain``: checkpoints
and step records from a loop a team might write itself (its scheduler may step once per
iteration, as several frameworks do), for the readers that must handle loops we did not write.

Run it with torchrun (gloo on CPU, nccl where CUDA is available), with the local job's switches:

    torchrun --standalone --nproc_per_node 2 tests/helpers/core_loop.py --save DIR --train-iters 8

It writes Megatron-LM's layout: ``DIR/iter_%07d/`` through ``dist_checkpointing.save`` with the
state Megatron-LM's ``generate_state_dict`` saves (args with consumed_train_samples, iteration,
model, optimizer, opt_param_scheduler, rng_state, num_floating_point_operations_so_far), then
``DIR/latest_checkpointed_iteration.txt``. Its data is synthetic but deterministic: sample ``i``
of the dataset is a function of ``(data_seed, i)`` and the order is Megatron's pretraining
sampler over a seeded permutation, so a resumed run sees exactly the batches it should.
"""

import argparse
import importlib.metadata
import math
import os
import sys
import time
from dataclasses import replace
from datetime import timedelta
from functools import partial

import numpy as np
import torch

from tasks.restore import cpu

cpu.install()  # before megatron is imported

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy  # noqa: E402
from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: E402
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, ParamKey, ParamPredicate, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler, ParamGroupOverride  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.rerun_state_machine import get_rerun_state_machine  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

from ckptops_records import StepRecorder, batch_summary  # noqa: E402
from infra.local_job import faults, records  # noqa: E402
from infra.local_job.faults import fail  # noqa: E402
from infra.local_job.records import notify_saved  # noqa: E402
from tasks.restore.build import (  # noqa: E402
    Built,
    build,
    gpt_provider,
    init_distributed,
    optimizer_config,
    set_seeds,
    transformer_config,
)
from tasks.restore.loader import load_state, rng_state_object  # noqa: E402

CHECKPOINT_VERSION = 3.0
TRACKER = "latest_checkpointed_iteration.txt"


# What each fault does to the failing rank. The texts are the errors CUDA and PyTorch print for
# these failures on a GPU; nan and hang are the real thing on any device.
def parse_args(argv=None):
    """Megatron-LM's argument names and defaults, for the switches this job has."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save", required=True, help="save directory (Megatron-LM --save)")
    p.add_argument("--load", default=None, help="resume from this save directory (Megatron-LM --load)")
    p.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="iteration to load (Megatron-LM --ckpt-step); default: Megatron's tracker",
    )
    p.add_argument(
        "--no-load-optim",
        action="store_true",
        help="Megatron-LM's flag: load neither optimizer nor scheduler",
    )
    records.add_arguments(p)  # the local job's: step records, the saved-checkpoint event
    faults.add_arguments(p)  # and its faults, to rehearse failures
    p.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="Megatron-LM's flag: with --load, exit non-zero when there is no checkpoint to load "
        "instead of starting from random weights",
    )
    p.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10,
        help="Megatron-LM's collective timeout (a fraction of a minute is allowed here)",
    )
    p.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="Megatron-LM's flag: do not end the job on a NaN gradient",
    )
    p.add_argument(
        "--scheduler-per-iteration",
        action="store_true",
        help="step the LR scheduler once per iteration (several frameworks do), not by the batch samples",
    )
    p.add_argument(
        "--own-param-groups",
        action="store_true",
        help="an optimizer config of the loop's own that its saved args do not imply: 3 x --lr for "
        "the decayed parameters, 1.5 x --lr for biases and 1-dim parameters, --min-lr / 2",
    )
    p.add_argument(
        "--megatron-core-configs",
        action="store_true",
        help="configure DDP and the optimizer in code with megatron-core's own configs, as a team's "
        "loop does, not from Megatron-LM's args: gradients reduced in fp32 "
        "(DistributedDataParallelConfig(grad_reduce_in_fp32=True)); the saved args hold no "
        "Megatron-LM name for it",
    )
    p.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="with --megatron-core-configs: gradient buckets of this many elements, reduced during "
        "the backward pass (overlap_grad_reduce=True, bucket_size=N)",
    )
    p.add_argument(
        "--writer",
        default="megatron-lm",
        choices=["megatron-lm", "bridge"],
        help="whose save writes the checkpoints: Megatron-LM's layout (this loop's save) or "
        "Megatron-Bridge's own save_checkpoint (tests/helpers/bridge_writer.py)",
    )
    p.add_argument("--bridge-vocab", help="with --writer bridge: the GPT-2 BPE vocab.json it keeps")
    p.add_argument("--bridge-merges", help="with --writer bridge: the GPT-2 BPE merges.txt it keeps")
    p.add_argument("--train-iters", type=int, default=8)
    p.add_argument("--save-interval", type=int, default=4)
    # The model.
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument(
        "--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden (SwiGLU: Megatron-LM's 8/3)"
    )
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--group-query-attention", action="store_true")
    p.add_argument("--num-query-groups", type=int, default=1)
    p.add_argument("--kv-channels", type=int, default=None, help="default: hidden / heads")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=128,
        help="the tokenizer's vocabulary (padded as Megatron-LM pads it)",
    )
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq-length")
    p.add_argument(
        "--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"]
    )
    p.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    p.add_argument("--qk-layernorm", action="store_true")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    # Parallelism, precision, optimizer.
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument(
        "--bf16", action="store_true", help="bf16 parameters, fp32 main parameters in the optimizer"
    )
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--lr-warmup-samples", type=int, default=16)
    p.add_argument("--lr-decay-samples", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-seed", type=int, default=4321)
    p.add_argument("--dataset-size", type=int, default=100_000)
    p.add_argument(
        "--verify-integrity",
        action="store_true",
        help="also write Megatron's integrity.json (sha256 of every file)",
    )
    return derive(p.parse_args(argv))


def derive(args):
    """What Megatron-LM's validate_args adds to the command line, and saves with every checkpoint."""
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (
            int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu else 4 * args.hidden_size
        )
    args.kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = -(-args.vocab_size // multiple) * multiple
    args.fp16 = False
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float32
    if not args.megatron_core_configs:
        # Megatron-LM reduces bf16 gradients in fp32.
        args.accumulate_allreduce_grads_in_fp32 = args.bf16
    args.hidden_dropout = args.attention_dropout = 0.0
    args.norm_epsilon, args.apply_layernorm_1p, args.add_qkv_bias = 1e-5, False, False
    args.rotary_percent, args.rotary_base, args.num_experts = 1.0, 10000, None
    args.optimizer, args.weight_decay, args.clip_grad = "adam", 0.01, 1.0
    args.no_save_optim = args.no_save_rng = False
    args.ckpt_fully_parallel_save = True
    args.transformer_impl = "local"
    return args


def checkpoint_dir(args) -> str | None:
    """The checkpoint to load: --ckpt-step, else Megatron's tracker; None when there is none."""
    step = args.ckpt_step
    if step is None:
        try:
            with open(os.path.join(args.load, TRACKER)) as f:
                step = int(f.read().strip())
        except FileNotFoundError:
            return None
    directory = os.path.join(args.load, f"iter_{step:07d}")
    return directory if os.path.isdir(directory) else None


def setup(args):
    """Process group, model, optimizer and scheduler, as Megatron-LM's setup does."""
    # The checkpoint writer otherwise starts a *spawn* Manager on first save (7-14 s here);
    # a fork-context queue created before the process group exists costs well under a second.
    filesystem_async.get_write_results_queue(mp_mode="fork")
    init_distributed(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        timedelta(minutes=args.distributed_timeout_minutes),
    )
    args.world_size = torch.distributed.get_world_size()
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise SystemExit(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"micro-batch-size x data-parallel size = {per_step}"
        )
    args.num_microbatches = args.global_batch_size // per_step
    set_seeds(args.seed)
    built = core_configs_build(args) if args.megatron_core_configs else build(args)
    if args.own_param_groups:
        built = replace(built, optimizer=own_optimizer(args, built.model))
    # Megatron-LM counts the schedule in samples; a loop stepping it per iteration counts iterations.
    per = args.global_batch_size if args.scheduler_per_iteration else 1
    scheduler = OptimizerParamScheduler(
        built.optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_samples // per,
        lr_decay_steps=args.lr_decay_samples // per,
        lr_decay_style="cosine",
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.lr_decay_samples // per,
        wd_incr_style="constant",
    )
    return built, scheduler


def core_configs_build(args) -> Built:
    """The model of the args, its DDP and optimizer configured in code with megatron-core's own
    configs (none of ckptops' builder beyond the model itself)."""
    config = transformer_config(args, initialize=True)
    chunk = gpt_provider(
        args,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        config=config,
    )
    if torch.cuda.is_available():
        chunk.cuda()
    if args.bf16:
        chunk = Float16Module(config, chunk)
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.ddp_bucket_size is not None,
        bucket_size=args.ddp_bucket_size,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=chunk)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            params_dtype=args.params_dtype,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        [model],
    )
    return Built(model, optimizer, config)


def own_optimizer(args, model):
    """The loop's own param groups (megatron's API, its own values): what a team's loop may
    configure in code rather than from its args."""
    config = replace(optimizer_config(args), lr=3 * args.lr, min_lr=args.min_lr / 2)
    no_decay = ParamKey(
        name="*.bias", predicate=ParamPredicate(name="param_len_1", fn=lambda param: len(param.shape) == 1)
    )
    overrides = {no_decay: ParamGroupOverride(wd_mult=0.0, max_lr=1.5 * args.lr)}
    return get_megatron_optimizer(config, [model], config_overrides=overrides)


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
        yield torch.stack([dataset.tokens(i) for i in batch_ids[first : first + args.micro_batch_size]])


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


def saved_args(args, iteration, consumed):
    """The args Megatron-LM stores: the run's settings plus its progress counters."""
    saved = argparse.Namespace(**vars(args))
    saved.iteration = iteration
    saved.consumed_train_samples = consumed
    saved.ckpt_format = "torch_dist"
    for name in args.drop_saved_arg:
        delattr(saved, name)
    return saved


def save_checkpoint(args, built, scheduler, iteration, consumed, flops):
    directory = os.path.join(args.save, f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    content_metadata = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        # What Megatron-LM records: how the distributed optimizer's state is laid out (its
        # default; --dist-ckpt-optim-fully-reshardable would make it "fully_reshardable").
        "distrib_optim_sharding_type": "dp_reshardable",
        # The installed distribution's version: megatron.core.__version__ appends the git
        # hash of whatever repository the job happens to run in.
        "megatron_core_version": importlib.metadata.version("megatron-core"),
        "torch_version": str(torch.__version__),
    }
    metadata = {
        **content_metadata,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    model_sd = built.module.sharded_state_dict(metadata=metadata)
    state_dict = {
        "args": saved_args(args, iteration, consumed),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "model": model_sd,
        "optimizer": built.optimizer.sharded_state_dict(model_sd, metadata=metadata),
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
        state_dict,
        directory,
        sharded_strategy=strategy,
        content_metadata=content_metadata,
        verify_integrity=args.verify_integrity,
    )
    if torch.distributed.get_rank() == 0:
        # Megatron-LM's own tracker, written the way Megatron-LM writes it (plain, not atomic).
        with open(os.path.join(args.save, TRACKER), "w") as f:
            f.write(str(iteration))
        print(
            f"saved checkpoint iteration {iteration} to {directory} in {time.perf_counter() - start:.2f}s",
            flush=True,
        )
        if args.notify_url:
            notify_saved(args, iteration)
    torch.distributed.barrier()


def _load_dir(args) -> str | None:
    """The checkpoint to resume from, as Megatron-LM decides it; exits when it must."""
    directory = checkpoint_dir(args)
    if directory is None and torch.distributed.get_rank() == 0:
        print(f"WARNING: could not find a checkpoint to load under {args.load}", flush=True)
        if not args.exit_on_missing_checkpoint:
            print("    will not load any checkpoints and will start from random", flush=True)
    if directory is None and args.exit_on_missing_checkpoint:
        print(
            f">> '--exit-on-missing-checkpoint' is set but no checkpoint was found under load "
            f"directory '{args.load}'. Exiting with a non-zero status. <<",
            flush=True,
        )
        torch.distributed.barrier()
        sys.exit(1)
    return directory


def reported_loss(args, losses) -> float:
    """The global batch's loss: computed on the last pipeline stage, averaged over the
    data-parallel ranks there, and sent to every stage (rank 0 records it)."""
    loss = torch.zeros((), dtype=torch.float32)
    if parallel_state.is_pipeline_last_stage():
        loss = torch.stack([x["lm loss"] for x in losses]).float().mean()
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss /= args.data_parallel_size
    if args.pipeline_model_parallel_size > 1:
        torch.distributed.broadcast(
            loss,
            parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return loss.item()


def model_parameters(built) -> int:
    """Parameters of the whole model (every tensor- and pipeline-parallel piece)."""
    count = torch.tensor(sum(p.numel() for p in built.model.parameters()), dtype=torch.float64)
    torch.distributed.all_reduce(count, group=parallel_state.get_model_parallel_group())
    return int(count.item())


def train(args):
    built, scheduler = setup(args)
    model, optimizer = built.model, built.optimizer
    dataset = SyntheticDataset(args)
    # Megatron's default mask is built on "cuda"; an explicit one works on both devices.
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    causal_mask = torch.triu(torch.ones(args.seq_length, args.seq_length, dtype=torch.bool, device=device), 1)
    causal_mask = causal_mask[None, None]
    forward_backward = get_forward_backward_func()
    # Megatron-LM's running total, approximated as 6 x parameters x tokens per iteration.
    flops_per_iteration = 6 * model_parameters(built) * args.global_batch_size * args.seq_length
    iteration, consumed, flops = 0, 0, 0.0
    directory = _load_dir(args) if args.load else None
    if directory and args.writer == "bridge":
        import bridge_writer  # beside this script, on sys.path when torchrun runs it

        iteration, consumed, flops = bridge_writer.load(args, built, scheduler)
    elif directory:
        loaded = load_state(
            directory,
            built,
            args,
            load_optim=not args.no_load_optim,
            load_rng=True,
            scheduler=scheduler,
        )
        iteration, consumed, flops = (
            loaded.iteration,
            loaded.consumed_train_samples,
            loaded.num_floating_point_operations_so_far,
        )
        print(f"resumed from iteration {iteration} after {consumed} samples", flush=True)
    rank0 = torch.distributed.get_rank() == 0
    recorder = StepRecorder(
        args.step_records if rank0 else None, args.run_id, args.attempt_id, flops_per_iteration
    )
    # Allocated and touched once: resident for the whole run, as a leak or a bigger buffer would be.
    ballast = torch.ones(args.ballast_mb << 18) if args.ballast_mb else None  # noqa: F841 (float32: 4 bytes each)
    fault = args.fail_at if args.fail_at and args.fail_at[0] == torch.distributed.get_rank() else None
    fail_before = fault[1] + (iteration if fault[3] else 0) if fault else None  # +N: after the load
    if args.writer == "bridge":
        import bridge_writer  # beside this script, on sys.path when torchrun runs it

        bridge_writer.start(args, iteration, consumed)
    while iteration < args.train_iters:
        if fault and fail_before == iteration + 1:
            fail(fault[2], model)
        batch_ids = global_batch_ids(args, dataset, consumed)
        # Megatron-LM's loop advances the rerun state machine once per step, so its NaN report
        # names the iteration that failed (1-based: the machine counts from 0).
        get_rerun_state_machine().current_iteration = iteration
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
        scheduler.step(increment=1 if args.scheduler_per_iteration else args.global_batch_size)
        loss = reported_loss(args, losses)
        if args.slow_step_ms:
            time.sleep(args.slow_step_ms / 1000)
        step_seconds = time.perf_counter() - started
        iteration += 1
        lr = scheduler.get_lr(optimizer.param_groups[0])
        recorder.record(
            iteration=iteration,
            consumed_samples=consumed + args.global_batch_size,
            lr=lr,
            batch=batch_summary(consumed, batch_ids),
            loss=loss,
            grad_norm=None if grad_norm is None else float(grad_norm),
            skipped=0 if updated else 1,
            nan=int(not math.isfinite(loss)),
            tokens=args.global_batch_size * args.seq_length,
            step_seconds=step_seconds,
        )
        consumed += args.global_batch_size
        flops += flops_per_iteration
        if args.writer == "bridge":
            norm = None if grad_norm is None else float(grad_norm)
            bridge_writer.log(args, built, iteration, consumed, loss, lr, norm, 0 if updated else 1)
        elif rank0:
            print(
                f"iteration {iteration} consumed {consumed} lr {lr:.3e} "
                f"loss {loss:.6f} grad_norm {grad_norm:.6f}",
                flush=True,
            )
        if iteration % args.save_interval == 0 and args.writer == "bridge":
            bridge_writer.save(args, built, scheduler, iteration, consumed, flops)
        elif iteration % args.save_interval == 0:
            save_checkpoint(args, built, scheduler, iteration, consumed, flops)
    recorder.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    # The guard is load-bearing: megatron's checkpoint writer starts processes that re-import
    # __main__; without it they would re-run the training job and hang the save.
    train(parse_args())
