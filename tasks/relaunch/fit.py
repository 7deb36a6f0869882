"""Before a resume: does the command that will run fit the checkpoint it loads? The rules.

A relaunch (and a continuation drill) runs the job's own batch script. The Megatron-LM flags
written in it (``tasks.relaunch.script``), or those Megatron-LM printed at start
(``tasks.relaunch.printed``), are compared with the arguments the checkpoint saved (its common
state), the way an operator would read both side by side:

- architecture or vocabulary differ: refused (the weights cannot mean the same model);
- TP, PP or EP differ: refused, unless a passing restore drill loaded this job's checkpoints
  onto that layout (a resharding ckptops has drilled: the caller hands in the drilled layouts),
  and then only with a person's approval;
- global batch, sequence length, data path or blend, split or seed differ (the data order and
  what a sample is), or the precision: refused unless a person approves;
- optimizer and schedule settings differ: a warning;
- the relaunch environment's megatron-core, torch, CUDA and NCCL against the writer's: a
  warning (the checkpoint records megatron-core and torch; CUDA and NCCL only where known;
  ``tasks.relaunch.versions`` asks the job's Python).

A value the script's reading could not settle (set at run time, refused by the parser as read,
written twice) is named and not compared. Only flags the script writes are compared: a flag a
wrapper sets (or a default) is not seen in the script, and the comparison says how many it
compared.
"""

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.facts import saved_args
from tasks.checkpoint.signing import Trust
from tasks.relaunch.script import ScriptArgs, script_args
from tasks.relaunch.versions import JOB_PYTHON_TIMEOUT_SECONDS, job_versions


class Kind(StrEnum):
    REFUSE = "refuse"  # never resumed with this difference
    RESHARD = "reshard"  # refused unless drilled onto this layout, and then approved
    APPROVE = "approve"  # refused unless a person approves
    WARN = "warn"  # said, not stopped on
    NOTE = "note"  # what could not be compared, and why


ARCHITECTURE = {
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "max_position_embeddings",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "normalization",
    "swiglu",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "untie_embeddings_and_output_weights",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
    "mtp_num_layers",
    "multi_latent_attention",
}
PRECISION = {"fp16", "bf16", "fp8"}
VOCABULARY = {"vocab_size", "tokenizer_type", "make_vocab_size_divisible_by"}
# Where the tokenizer's files are: elsewhere may be a move (approve), or another vocabulary.
TOKENIZER_FILES = {"tokenizer_model", "vocab_file", "merge_file"}
LAYOUT = {
    "tensor_model_parallel_size": "TP",
    "pipeline_model_parallel_size": "PP",
    "expert_model_parallel_size": "EP",
}
DATA = {
    "global_batch_size",
    "rampup_batch_size",
    "seq_length",
    "data_path",
    "train_data_path",
    "data_args_path",
    "per_split_data_args_path",
    "split",
    "mock_data",
    "seed",
}
# Switches that make a load restore less than the checkpoint holds (iteration, optimizer, RNG,
# the scheduler's own state).
LOAD = {"finetune", "no_load_optim", "no_load_rng", "override_opt_param_scheduler"}
OPTIMIZER = {
    "optimizer",
    "lr",
    "min_lr",
    "lr_decay_style",
    "lr_decay_iters",
    "lr_decay_samples",
    "lr_warmup_iters",
    "lr_warmup_fraction",
    "lr_warmup_samples",
    "lr_warmup_init",
    "lr_wsd_decay_style",
    "lr_wsd_decay_iters",
    "train_iters",
    "train_samples",
    "weight_decay",
    "start_weight_decay",
    "end_weight_decay",
    "weight_decay_incr_style",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "sgd_momentum",
    "clip_grad",
    "use_distributed_optimizer",
}
KIND_OF = {
    **{d: Kind.REFUSE for d in ARCHITECTURE | VOCABULARY},
    **{d: Kind.RESHARD for d in LAYOUT},
    **{d: Kind.APPROVE for d in DATA | PRECISION | TOKENIZER_FILES | LOAD},
    **{d: Kind.WARN for d in OPTIMIZER},
}
WHAT = {
    **{d: "architecture" for d in ARCHITECTURE},
    **{d: "vocabulary" for d in VOCABULARY},
    **{d: "tokenizer files" for d in TOKENIZER_FILES},
    **{d: "layout" for d in LAYOUT},
    **{d: "data" for d in DATA},
    **{d: "load" for d in LOAD},
    **{d: "precision" for d in PRECISION},
    **{d: "optimizer" for d in OPTIMIZER},
}
# What Megatron-LM takes from the checkpoint, whatever the script says, with
# --use-checkpoint-args (megatron/training/checkpointing.py, load_args_from_checkpoint: the
# arguments it sets with force=True; the others only where the script leaves them unset), with
# --use-mp-args-from-checkpoint-args (the layout) and --use-tokenizer-model-from-checkpoint-args.
TAKEN_FROM_CHECKPOINT = {
    "use_checkpoint_args": {
        "num_query_groups",
        "group_query_attention",
        "position_embedding_type",
        "rotary_base",
        "rotary_percent",
        "add_bias_linear",
        "add_qkv_bias",
        "swiglu",
        "untie_embeddings_and_output_weights",
        "normalization",
        "num_experts",
        "mtp_num_layers",
        "moe_layer_freq",
        "moe_ffn_hidden_size",
        "moe_router_topk",
        "moe_shared_expert_intermediate_size",
    },
    "use_mp_args_from_checkpoint_args": set(LAYOUT),
    "use_tokenizer_model_from_checkpoint_args": {"tokenizer_model", "tokenizer_type"},
}


@dataclass
class Difference:
    name: str  # Megatron-LM's argument name
    kind: Kind
    words: str


@dataclass
class Compatibility:
    checkpoint: int
    script: str
    compared: int
    differences: list[Difference] = field(default_factory=list)
    versions: dict | None = None  # the relaunch environment's, as asked (``job_versions``)

    def of(self, *kinds: Kind) -> list[Difference]:
        return [d for d in self.differences if d.kind in kinds]

    @property
    def refused(self) -> list[Difference]:
        return self.of(Kind.REFUSE, Kind.RESHARD)

    @property
    def needs_approval(self) -> list[Difference]:
        return self.of(Kind.APPROVE)

    def summary(self) -> str:
        counted = {k: len(self.of(k)) for k in (Kind.REFUSE, Kind.RESHARD, Kind.APPROVE, Kind.WARN)}
        said = ", ".join(f"{n} {k}" for k, n in counted.items() if n) or "no difference"
        return (
            f"{self.script} against checkpoint {self.checkpoint}: {self.compared} Megatron-LM arguments "
            f"compared, {said}"
        )

    def lines(self) -> list[str]:
        return [f"{d.kind}: {d.words}" for d in self.differences]


def _same(a, b) -> bool:
    """Equal as Megatron-LM would use them; and never a difference that reads the same both ways."""
    return _equal(a, b) or _shown(a) == _shown(b)


def _equal(a, b) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)
    return str(a) == str(b)


def _said(flag: str, name: str, value, before) -> str:
    """The difference in words: a switch by whether it is given (``--disable-bias-linear`` is
    ``add_bias_linear`` False), a value by its value."""
    if isinstance(value, bool):
        return f"{flag} is given ({name} {value}), the checkpoint was saved with {name} {before}"
    return f"{flag} is {_shown(value)}, the checkpoint was saved with {_shown(before)}"


def _shown(value) -> str:
    if isinstance(value, list | tuple):
        return " ".join(map(str, value))
    return str(getattr(value, "name", value))


def compare(
    iteration: int,
    saved,
    script: ScriptArgs,
    drilled: dict[tuple[int, int], str] | None = None,
    writer: dict | None = None,
    versions: dict | None = None,
) -> Compatibility:
    """The script's flags against the checkpoint's saved ``args``. ``drilled``: the layouts
    (TP, PP) a passing restore drill loaded this job's checkpoints onto, with that drill's
    id. ``writer``: the versions the manifest recorded; ``versions``: the relaunch
    environment's (``job_versions``), None when not asked."""
    found = Compatibility(iteration, str(script.script), 0, versions=versions)
    add = lambda kind, name, words: found.differences.append(Difference(name, kind, words))  # noqa: E731
    taken = {
        name: switch
        for switch, names in TAKEN_FROM_CHECKPOINT.items()
        if script.values.get(switch)
        for name in names
    }
    layout_changed = False
    for name, value in sorted(script.values.items()):
        kind = KIND_OF.get(name)
        if kind is None:
            continue
        if not hasattr(saved, name):
            add(Kind.NOTE, name, f"{script.flags[name]}: the checkpoint's args do not have {name}")
            continue
        found.compared += 1
        before = getattr(saved, name)
        if _same(before, value):
            continue
        said = _said(script.flags[name], name, value, before)
        if name in script.as_text:
            found.compared -= 1
            typed = "Megatron-LM types it with its own code, not run on the script's text here"
            add(Kind.NOTE, name, f"{name}: {said} as written ({typed}): not compared")
        elif name in taken:
            switch = "--" + taken[name].replace("_", "-")
            add(Kind.NOTE, name, f"{said} ({switch}: Megatron-LM takes the checkpoint's)")
        elif kind is Kind.RESHARD:
            layout_changed = True
        else:
            add(kind, name, f"{WHAT[name]}: {said}: {CONSEQUENCE[WHAT[name]]}")
    if layout_changed:
        _layout(found, saved, script, drilled or {})
    for name, said in sorted(script.refused.items()):
        if name in KIND_OF:
            add(Kind.NOTE, name, f"{WHAT[name]}: {said}: not compared")
    for name, written in sorted(script.unresolved.items()):
        if name in KIND_OF:
            add(Kind.NOTE, name, f"{name}: {written}: not compared")
    if not found.compared:
        add(
            Kind.NOTE,
            "script",
            "the script writes none of the Megatron-LM arguments compared here (a wrapper or a config "
            "file may set them): nothing was compared",
        )
    if versions is not None:
        _versions(found, writer or {}, versions)
    return found


CONSEQUENCE = {
    "architecture": "the checkpoint's weights are not this model's",
    "vocabulary": "the embedding's rows would stand for other tokens",
    "tokenizer files": "approve if the files only moved; other files are another vocabulary",
    "load": "the relaunch restores less than the checkpoint holds",
    "data": "the data order, or what a sample is, changes from here on",
    "precision": "the model computes in another precision from here on",
    "optimizer": "the optimizer goes on differently than it would have",
}


def layout_of(args) -> tuple[int, int, int]:
    get = lambda name: int(getattr(args, name, None) or 1)  # noqa: E731
    return (
        get("tensor_model_parallel_size"),
        get("pipeline_model_parallel_size"),
        get("expert_model_parallel_size"),
    )


def _layout(found: Compatibility, saved, script: ScriptArgs, drilled: dict) -> None:
    """TP and PP a drill can prove (it loads the checkpoint onto another TP x PP, with the job's
    experts as they were); EP no drill reshards, so a change of it is refused."""
    before = layout_of(saved)
    after = tuple(int(script.values.get(name, value)) for name, value in zip(LAYOUT, before, strict=True))
    labels = zip(LAYOUT.values(), before, after, strict=True)
    words = " x ".join(f"{label} {b}->{a}" for label, b, a in labels if a != b)
    drill = drilled.get(after[:2]) if after[2] == before[2] else None
    if drill is not None:
        drilled_by = f"drill {drill} loaded this job's checkpoint onto it"
        said = f"layout: {words}: {drilled_by}; needs a person's approval"
        found.differences.append(Difference("layout", Kind.APPROVE, said))
        return
    why = (
        "no restore drill reshards experts"
        if after[2] != before[2]
        else "a resharding no restore drill of this job has loaded (drill onto it first: drill.layout)"
    )
    found.differences.append(Difference("layout", Kind.RESHARD, f"layout: {words}: {why}, refused"))


def _versions(found: Compatibility, writer: dict, versions: dict) -> None:
    add = lambda kind, name, words: found.differences.append(Difference(name, kind, words))  # noqa: E731
    if "error" in versions:
        add(Kind.NOTE, "versions", f"the relaunch environment's versions: {versions['error']}")
        return
    for name, label in (("megatron_core", "megatron-core"), ("torch", "torch")):
        wrote, now = writer.get(name), versions.get(name)
        if wrote is None or now is None:
            said = f"the writer's {wrote or 'unrecorded'}, the relaunch's {now or 'unknown'}"
            add(Kind.NOTE, name, f"{label}: {said}")
        elif str(wrote) != str(now):
            add(Kind.WARN, name, f"{label}: the relaunch runs {now}, the checkpoint was written by {wrote}")
    for name, label in (("cuda", "CUDA"), ("nccl", "NCCL")):
        wrote, now = writer.get(name), versions.get(name)
        if wrote is not None and now is not None and str(wrote) != str(now):
            add(Kind.WARN, name, f"{label}: the relaunch runs {now}, the checkpoint was written with {wrote}")
        elif wrote is None:
            said = f"the relaunch runs {now or 'none'}; the checkpoint does not record the writer's"
            add(Kind.NOTE, name, f"{label}: {said}")


def checkpoint_fit(
    profile,
    directory: Path,
    script: Path,
    environ: dict[str, str],
    drilled: dict[tuple[int, int], str],
    versions: dict | None = None,
) -> Compatibility:
    """``script`` (run in ``environ``) against the checkpoint in ``directory``: its saved args,
    the layouts ``drilled`` (TP, PP) a passing restore drill loaded this job's checkpoints onto
    (with that drill's id), and the relaunch environment's versions against the writer's when
    ``recovery.job_python`` says how to ask (``versions``: as an earlier comparison asked them;
    they do not change with the checkpoint)."""
    saved, writer = saved_args(directory, Trust.of(profile, Path(directory).parent))
    found = script_args(script, environ)
    recovery = getattr(profile, "recovery", None)
    if versions is None:
        versions = (
            job_versions(recovery.job_python, JOB_PYTHON_TIMEOUT_SECONDS)
            if recovery is not None and recovery.job_python
            else {"error": "not asked (recovery.job_python is not set)"}
        )
    return compare(layout.parse_iter_dir(Path(directory).name), saved, found, drilled, writer, versions)
