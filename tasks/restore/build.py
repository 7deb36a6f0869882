"""Build a Megatron-Core model and optimizer from Megatron-LM arguments, as Megatron-LM does.

One builder for the drill's loader (a model the checkpoint describes) and the local training job
(a model its command line describes), so that what the job saves is what the drill rebuilds.
Megatron-LM's order: the model chunk from a model provider (GPT through megatron-core's local
layer spec, or the job's own provider), ``Float16Module`` for bf16/fp16 parameters, DDP, then
``get_megatron_optimizer`` with fp32 main parameters. Megatron-LM's gpt builder picks the
Transformer Engine spec on GPUs; the local spec saves and loads under the same checkpoint keys
(its ``sharded_state_dict_keys_map``), so a drill needs no Transformer Engine.

Import this module only after ``tasks.restore.cpu.install()``: on a machine without a GPU the
patches must be in place before megatron is imported.
"""

import dataclasses
import datetime
import importlib
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from tasks.errors import UsageError
from tasks.restore import buffers
from tasks.restore.model_args import ModelArgsError

# Process-group set-up can wait on ranks still importing torch and megatron (seconds each on a
# busy machine); a rank that never arrives must still end the job, not hang it.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def ranks_from_slurm() -> None:
    """One task per rank under srun (no torchrun): torch reads RANK, WORLD_SIZE and LOCAL_RANK,
    which srun names SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID (the batch script sets
    MASTER_ADDR and MASTER_PORT)."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def init_distributed(
    tensor_parallel: int, pipeline_parallel: int, timeout: datetime.timedelta = PROCESS_GROUP_TIMEOUT
) -> None:
    """One process group per job (gloo on CPU, nccl on GPU), from torchrun's environment or
    Slurm's (``ranks_from_slurm``). ``timeout`` bounds every collective: a rank that stops
    answering ends the others' wait with an error instead of a hang (Megatron-LM's
    --distributed-timeout-minutes)."""
    ranks_from_slurm()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group(
        backend="nccl" if torch.cuda.is_available() else "gloo", timeout=timeout
    )
    world = torch.distributed.get_world_size()
    if world % (tensor_parallel * pipeline_parallel):
        raise UsageError(
            f"world size {world} is not a multiple of TP {tensor_parallel} x PP {pipeline_parallel}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        distributed_timeout_minutes=timeout.total_seconds() / 60,
    )


def transformer_config(args, initialize: bool) -> TransformerConfig:
    """The ``TransformerConfig`` of a GPT from its Megatron-LM args (what
    ``core_transformer_config_from_args`` takes from them that decides the parameters; kernel
    fusions are left at their defaults, which run everywhere). ``initialize``: give the weights
    their initial values (training); a load overwrites them, so it skips the work."""
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        qk_layernorm=args.qk_layernorm,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=initialize,
    )
    if args.num_experts:
        kwargs.update(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size,
        )
    try:
        return TransformerConfig(**kwargs)
    except (AssertionError, ValueError, TypeError) as e:
        raise ModelArgsError(
            f"args: megatron-core's TransformerConfig refuses them ({e or type(e).__name__})"
        ) from None


def gpt_provider(
    args, pre_process: bool = True, post_process: bool = True, vp_stage=None, config=None, pg_collection=None
) -> GPTModel:
    """Megatron-LM's ``gpt_builder`` for the local layer spec."""
    config = config or transformer_config(args, initialize=True)
    spec = get_gpt_layer_local_spec(
        config.num_moe_experts, False, config.qk_layernorm, normalization=config.normalization
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
    )


def import_provider(spec: str):
    """``package.module:function``, the job's own model builder (a usage error if it does not
    import: that is the profile's fault, not the checkpoint's)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UsageError(f"drill.model_provider {spec!r}: expected 'package.module:function'")
    try:
        provider = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise UsageError(
            f"drill.model_provider {spec!r}: cannot be imported ({type(e).__name__}: {e})"
        ) from None
    if not callable(provider):
        raise UsageError(f"drill.model_provider {spec!r}: not callable")
    return provider


def _copy_fields(cls, args, **overrides):
    """Megatron-LM's way to fill a megatron-core config: every field the args also have."""
    kwargs = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(args, f.name)
    }
    kwargs.update(overrides)
    return kwargs


def ddp_config(args, num_parameters: int) -> DistributedDataParallelConfig:
    """As Megatron-LM's ``get_megatron_ddp_config`` and ``resolve_ddp_bucket_size``. The bucket
    size decides the distributed optimizer's bucket layout, which a ``dp_reshardable`` checkpoint
    stores: it is resolved with the job's data-parallel size (from its args), so a drill on fewer
    ranks rebuilds the buckets the job had."""
    overlap = bool(getattr(args, "overlap_grad_reduce", False))
    bucket_size = None
    if overlap:
        if getattr(args, "ddp_num_buckets", None):
            bucket_size = num_parameters // args.ddp_num_buckets
        else:
            bucket_size = getattr(args, "ddp_bucket_size", None) or max(
                40_000_000, 1_000_000 * int(getattr(args, "data_parallel_size", 1) or 1)
            )
    # Megatron-LM's name for it, else megatron-core's own (a job that saved its DDP config's fields).
    grad_reduce_in_fp32 = getattr(
        args, "accumulate_allreduce_grads_in_fp32", getattr(args, "grad_reduce_in_fp32", False)
    )
    kwargs = _copy_fields(
        DistributedDataParallelConfig,
        args,
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        grad_reduce_in_fp32=bool(grad_reduce_in_fp32),
        overlap_grad_reduce=overlap,
        overlap_param_gather=False,
        bucket_size=bucket_size,
        # Megatron-LM's --check-for-nan-in-loss-and-grad (on by default): a NaN gradient ends
        # the job with the rerun state machine's "Unexpected result nan" before it is reduced.
        check_for_nan_in_grad=bool(getattr(args, "check_for_nan_in_loss_and_grad", False)),
    )
    return DistributedDataParallelConfig(**kwargs)


def optimizer_config(args) -> OptimizerConfig:
    return OptimizerConfig(
        **_copy_fields(OptimizerConfig, args, use_distributed_optimizer=bool(args.use_distributed_optimizer))
    )


@dataclass
class Built:
    model: DistributedDataParallel  # the one model chunk of this rank, wrapped as Megatron-LM wraps it
    optimizer: object  # megatron's optimizer (fp32 main params for bf16/fp16)
    config: TransformerConfig
    notes: list[str] = field(default_factory=list)  # what the saved buffers settled against the args

    @property
    def module(self):
        return self.model.module


def build(args, provider=None, initialize: bool = True, saved_buffers: dict | None = None) -> Built:
    """Model and optimizer for this rank (after ``init_distributed``). ``provider`` defaults to
    the GPT builder; a job's own is called as Megatron-LM calls a model provider.
    ``saved_buffers`` (``buffers.saved_buffers`` of a checkpoint to load): DDP's gradient dtype
    and buckets as that checkpoint's distributed optimizer saved them, whatever the args say."""
    pre, post = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    if provider is None:
        config = transformer_config(args, initialize)
        chunk = gpt_provider(args, pre_process=pre, post_process=post, config=config)
    else:
        chunk = provider(args, pre_process=pre, post_process=post)
        config = chunk.config
    if torch.cuda.is_available():
        chunk.cuda()
    if args.bf16 or args.fp16:
        chunk = Float16Module(config, chunk)
    parameters = sum(p.numel() for p in chunk.parameters())
    ddp, notes = ddp_config(args, parameters), []
    if saved_buffers:
        fitted = buffers.fit(ddp, [p for p in chunk.parameters() if p.requires_grad], saved_buffers)
        ddp, notes = fitted.ddp_config, fitted.notes
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=chunk)
    # What Megatron-LM's setup does: without it the schedule never all-reduces the gradients.
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(optimizer_config(args), [model])
    return Built(model, optimizer, config, notes)


def set_seeds(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
