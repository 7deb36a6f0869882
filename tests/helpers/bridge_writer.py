"""Megatron-Bridge's own checkpointing and logging (0.6.2) for the Megatron-Core loop of
``core_loop.py`` (``--writer bridge``): its ``save_checkpoint`` writes the layout NeMo's recipes
write, its ``load_checkpoint`` resumes from it, its ``training_log`` prints the iteration lines
and its ``log_non_default_values`` the configuration summary: Bridge's code, not a copy of it.

Bridge declares GPU-only dependencies, so the Makefile installs it with --no-deps; what its
checkpointing needs to import and save on a CPU is pyproject's ``bridge`` extra. One import
cannot be satisfied here at all: ``megatron/bridge/peft/lora_layers.py`` imports Transformer
Engine unguarded (for its LoRA layers, which a save never touches), so an empty
``transformer_engine`` module stands in for the import, after Megatron-Core has decided that
Transformer Engine is absent.
"""

import sys
import types

import torch
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator


class _Absent(types.ModuleType):
    """Transformer Engine for an import that names its classes and never uses them."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self.__name__}.{name}") if name.islower() else type(name, (), {})


def _import_bridge():
    import megatron.core.models.gpt  # noqa: F401 (decides HAVE_TE before the stand-in exists)

    if "transformer_engine" not in sys.modules:
        te = _Absent("transformer_engine")
        te.__path__, te.__version__ = [], "0.0.0"
        sys.modules.update({"transformer_engine": te, "transformer_engine.pytorch": te.pytorch})
    from megatron.bridge.training import checkpointing, config, state
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    return checkpointing, config, state, TokenizerConfig


class _Dataloader:
    """The loop's data position, saved through Bridge's dataloader-state hook (which Energon's
    loaders implement): the sample position each data-parallel rank reads next."""

    def __init__(self, args, consumed: int):
        self.args, self.consumed = args, consumed

    def save_state(self) -> dict:
        dp_rank = parallel_state.get_data_parallel_rank()
        return {
            "consumed_samples": self.consumed,
            "dp_rank": dp_rank,
            "micro_batch_size": self.args.micro_batch_size,
        }


class _Iterator:
    def __init__(self, iterable):
        self.iterable = iterable


def _config(args, modules):
    checkpointing, config, state, TokenizerConfig = modules
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    model = GPTModelProvider(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        normalization=args.normalization,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        bf16=args.bf16,
    )
    tokenizer = TokenizerConfig(
        tokenizer_type="GPT2BPETokenizer", vocab_file=args.bridge_vocab, merge_file=args.bridge_merges
    )
    return config.ConfigContainer(
        train=config.TrainingConfig(
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            train_iters=args.train_iters,
        ),
        model=model,
        optimizer=config.OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        scheduler=config.SchedulerConfig(
            lr_decay_style="cosine",
            lr_warmup_samples=args.lr_warmup_samples,
            lr_decay_samples=args.lr_decay_samples,
        ),
        dataset=types.SimpleNamespace(tokenizer=_Tokenizer(), dataloader_save=None),
        logger=config.LoggerConfig(log_interval=1),
        tokenizer=tokenizer,
        checkpoint=config.CheckpointConfig(
            save=args.save,
            save_interval=args.save_interval,
            load=args.load,
            ckpt_step=args.ckpt_step,
            exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
            ckpt_format="torch_dist",
            fully_parallel_save=True,
        ),
    )


class _Tokenizer:
    """Bridge copies a GPT-2 BPE tokenizer's files (the config's vocab and merges) into the
    checkpoint's ``tokenizer/``; the instance only has to be there."""


_STATE = {}


def _global_state(args):
    if "state" not in _STATE:
        modules = _import_bridge()
        global_state = modules[2].GlobalState()
        global_state.cfg = _config(args, modules)
        dp = global_state.cfg.data_parallel_size = parallel_state.get_data_parallel_world_size()
        init_num_microbatches_calculator(
            torch.distributed.get_rank(), None, args.global_batch_size, args.micro_batch_size, dp
        )
        _STATE.update(state=global_state, save=modules[0].save_checkpoint, context={}, totals={})
    return _STATE["state"]


def load(args, built, scheduler) -> tuple[int, int, float]:
    """Resume through Bridge's own load_checkpoint (its tracker, its train_state.pt, its load
    line): the iteration, consumed samples and FLOPs it restored."""
    global_state = _global_state(args)  # imports Bridge
    from megatron.bridge.training.checkpointing import load_checkpoint

    _, flops = load_checkpoint(global_state, [built.module], built.optimizer, scheduler)
    train_state = global_state.train_state
    return train_state.step, train_state.consumed_train_samples, float(flops)


def start(args, iteration: int, consumed: int) -> None:
    """Before the first iteration: Bridge's configuration summary printed (its setup prints it
    in place of Megatron-LM's arguments block), its progress counters where the run starts,
    and its interval timer running (its loop starts it before training)."""
    global_state = _global_state(args)
    global_state.cfg.log_non_default_values()
    global_state.train_state.step, global_state.train_state.consumed_train_samples = iteration, consumed
    _STATE["loaded"] = iteration
    global_state.timers("interval-time", log_level=0).start(barrier=True)


def log(args, built, iteration: int, consumed: int, loss: float, lr: float, grad_norm, skipped: int) -> None:
    """One iteration's line, printed by Bridge's own ``training_log`` (its format, its fields)."""
    from megatron.bridge.training.utils.train_utils import training_log

    global_state = _global_state(args)
    global_state.train_state.step, global_state.train_state.consumed_train_samples = iteration, consumed
    totals = _STATE["totals"]
    totals.setdefault("lm loss", torch.zeros(1))  # Bridge's default accumulator is a CUDA tensor
    training_log(
        {"lm loss": torch.tensor([loss])},
        totals,
        lr,
        None,
        1.0,
        False,
        skipped,
        grad_norm,
        None,
        None,
        global_state.cfg,
        global_state,
        [],
        [built.module],
        loaded_iteration=_STATE["loaded"],
        seq_length=args.seq_length,
    )


def save(args, built, scheduler, iteration: int, consumed: int, flops: float) -> None:
    """One checkpoint through Bridge's save_checkpoint, as its train loop calls it."""
    global_state = _global_state(args)
    train_state = global_state.train_state
    train_state.step, train_state.consumed_train_samples = iteration, consumed
    train_state.floating_point_operations_so_far = flops
    train_state.do_train = True
    _STATE["save"](
        global_state,
        [built.module],
        built.optimizer,
        scheduler,
        flops,
        checkpointing_context=_STATE["context"],
        train_data_iterator=_Iterator(_Dataloader(args, consumed)),
    )
