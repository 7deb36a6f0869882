"""Before a resume: does the command that will run fit the checkpoint it loads?

A relaunch (and a continuation drill) runs the job's own batch script. The Megatron-LM flags
written in it are compared with the arguments the checkpoint saved (its common state), the
way an operator would read both side by side:

- architecture or vocabulary differ: refused (the weights cannot mean the same model);
- TP, PP or EP differ: refused, unless a passing restore drill loaded this job's checkpoints
  onto that layout (a resharding ckptops has drilled), and then only with a person's approval;
- global batch, sequence length, data path or blend, split or seed differ (the data order and
  what a sample is), or the precision: refused unless a person approves;
- optimizer and schedule settings differ: a warning;
- the relaunch environment's megatron-core, torch, CUDA and NCCL against the writer's: a
  warning (the checkpoint records megatron-core and torch; CUDA and NCCL only where known).

The script is read, never run: its tokens (``shlex``), its own scalar assignments and the
environment the relaunch inherits resolve ``$VAR`` and ``${VAR:-default}`` (a word that is only
a variable, ``torchrun ... $GPT_ARGS`` or ``eval "$CMD"``, is the words it holds); a value still
holding a ``$`` or a backtick (a positional parameter, a command substitution) is named as not
compared, and so is what a heredoc holds. Flags are recognised by Megatron-LM's own argument
parser and typed by the standard types it gives them, so ``--lr=6e-5`` and ``--lr 0.00006`` are
the same; a flag Megatron-LM types with its own code (``--moe-layer-freq "[0]*4"``, which it
evaluates) is compared as the text written, never run here. In one command the last of a
repeated flag holds, as argparse takes it.

This reading is a pre-check, and it refuses only what it read for certain: a value the parser
would refuse, or two readings of one flag, is not compared. The authority is what Megatron-LM
prints at start (``tasks.resume.printed_args``). Only flags the script writes are compared: a
flag a wrapper sets (or a default) is not seen here, and the comparison says how many it
compared.
"""

import argparse
import json
import logging
import re
import shlex
import warnings
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.facts import saved_args
from tasks.cluster import process
from tasks.errors import unreadable
from tasks.restore.history import drilled_layouts
from tasks.storage.local import open_regular


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


class _Refusal(Exception):
    """argparse's error, as an exception: one bad value is reported, never an exit."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _Refusal(message)


@cache
def megatron_parser() -> _Parser:
    """Megatron-LM's own argument parser (megatron.training.arguments), with no defaults: a
    parse yields exactly the flags it was given. Importing it takes seconds; done once. The
    import installs a handler on the root logger, writing INFO to stdout (which the CLI keeps
    for its answer), and warns of every missing GPU library: both are undone here."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments
    root.handlers[:], root.level = handlers, level
    parser = add_megatron_arguments(_Parser(allow_abbrev=False, add_help=False))
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return parser


# ---------------------------------------------------------------- the script's flags

_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_SHELL = set("();|&<>#")


@dataclass
class ScriptArgs:
    """The Megatron-LM flags a batch script writes: resolved values by argument name, the flag
    as written, and the arguments whose value the script leaves to run time."""

    script: Path
    values: dict[str, object] = field(default_factory=dict)
    flags: dict[str, str] = field(default_factory=dict)
    unresolved: dict[str, str] = field(default_factory=dict)  # name -> the value as written
    refused: dict[str, str] = field(default_factory=dict)  # name -> what Megatron-LM's parser says
    written: dict[str, str] = field(default_factory=dict)  # name -> its value as last read
    conflicting: set[str] = field(default_factory=set)  # names read with two values
    as_text: set[str] = field(default_factory=set)  # names whose value is the text written (not typed)
    command: dict[str, int] = field(default_factory=dict)  # name -> the command it was last read in


_COMMENT = re.compile(r"(^|\s)#.*$")
# A file descriptor written against its redirection (the 2 of 2>&1): not a word of the command.
_DESCRIPTOR = re.compile(r"(^|\s)\d+(?=[<>])")
_HEREDOC = re.compile(r"<<(-?)\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")


def _commands(text: str) -> list[str]:
    """The script's lines, continued lines joined, each heredoc's body left out (what it holds
    is a file's or a command's input, not a command of the script)."""
    kept, ending = [], None
    for line in text.replace("\\\n", " ").splitlines():
        if ending is not None:
            if line.strip() == ending or line == ending:
                ending = None
            continue
        kept.append(line)
        opened = _HEREDOC.search(_COMMENT.sub("", line))
        if opened:
            ending = opened[3]
    return kept


def _lines(text: str) -> list[list[str]]:
    """The script's commands, each as its tokens (continued lines joined, comments dropped: a
    ``#`` that starts a word, never one inside a path): a flag's values never run on into the
    next command."""
    lines = []
    for line in _commands(text):
        line = _DESCRIPTOR.sub(r"\1", _COMMENT.sub("", line))
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, ""
        try:
            tokens = _substitutions(list(lexer))
        except ValueError:  # a quote that spans lines: its words as they stand
            tokens = line.split()
        lines.append([word for token in tokens for word in _flag_words(token)])
    return lines


def _flag_words(token: str) -> list[str]:
    """A quoted array element holding a flag and its value (``"--fp8-format hybrid"``, as
    Megatron-LM's own scripts write them) is split where the array is expanded unquoted: its
    words, as bash would split them."""
    if token.startswith("--") and any(c.isspace() for c in token):
        return _split(token)
    return [token]


def _substitutions(tokens: list[str]) -> list[str]:
    """``$(...)`` back in one word (the lexer splits its parentheses off, as it must for arrays)."""
    joined, depth = [], 0
    for token in tokens:
        if depth:
            joined[-1] += token if token in "()" or joined[-1].endswith("(") else f" {token}"
            depth += token.count("(") - token.count(")")
        elif joined and joined[-1].endswith("$") and token == "(":
            joined[-1] += token
            depth = 1
        else:
            joined.append(token)
    return joined


def _assignments(tokens: list[str]) -> dict[str, str | None]:
    """The script's scalar assignments; a name assigned two different values is None (which
    one holds depends on a branch taken at run time)."""
    found: dict[str, str | None] = {}
    for token in tokens:
        match = _ASSIGNMENT.match(token)
        if match and not token.startswith("-"):
            name, value = match.groups()
            found[name] = value if found.get(name, value) == value else None
    return found


def _resolve(value: str, assigned: dict, environ: dict, depth: int = 0) -> str:
    """``value`` with its variable references replaced where the script or the environment
    settles them, as bash would: the script's own assignment (one that does not read the
    variable itself), else the environment, else ``${NAME:-default}``'s default (``${NAME-d}``:
    only when unset). What is left unsettled keeps its ``$``."""

    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(4)
        colon, default = match.group(2), match.group(3)
        own = assigned.get(name)
        if own is not None and not re.search(rf"\$\{{?{name}\b", own):
            found = own
        elif own is not None and default is None:
            found = own  # NAME=${NAME:-x} read as $NAME: its own default decides
        elif name in environ and (environ[name] or not colon):
            found = environ[name]
        else:
            found = default
        if found is None or depth > 8:
            return match.group(0)
        return _resolve(found, assigned, environ, depth + 1)

    return _REFERENCE.sub(one, value)


def script_args(script: Path, environ: dict[str, str]) -> ScriptArgs:
    """The Megatron-LM flags ``script`` writes, typed by Megatron-LM's parser; ``environ`` is
    what the relaunch inherits (sbatch --export=ALL, or the local launcher's environment)."""
    try:
        with open_regular(Path(script)) as f:  # a FIFO would hang the reader: one line instead
            text = f.read().decode(errors="replace")
    except OSError as e:
        raise unreadable(script, e) from None
    parser, found = megatron_parser(), ScriptArgs(Path(script))
    lines = _lines(text)
    assigned = _assignments([token for line in lines for token in line])
    known = parser._option_string_actions
    for number, line in enumerate(lines):
        tokens = _expanded(line, assigned, environ)
        for i, token in enumerate(tokens):
            if token.split("=", 1)[0] in known and token.startswith("--"):
                _read_flag(found, parser, tokens[i:], assigned, environ, number)
    return found


def _expanded(tokens: list[str], assigned: dict, environ: dict) -> list[str]:
    """A word that is only a variable holding flags (``$GPT_ARGS``, ``eval "$CMD"``) as the
    words it holds, as bash splits an unquoted expansion."""
    words = []
    for token in tokens:
        settled = _resolve(token, assigned, environ) if _REFERENCE.fullmatch(token) else token
        words += _split(settled) if settled != token and "--" in settled else [token]
    return words


def _values(tokens: list[str], nargs) -> list[str]:
    """The words after a flag that are its values: as many as its ``nargs`` takes, up to the
    next flag or the end of the command."""
    taken = []
    for value in tokens:
        if value[:1] in _SHELL or (value.startswith("-") and not _number(value)):
            break
        taken.append(value)
    wanted = {None: 1, "?": 1}.get(nargs, nargs)
    return taken[:wanted] if isinstance(wanted, int) else taken


def _read_flag(
    found: ScriptArgs, parser: _Parser, tokens: list[str], assigned: dict, environ: dict, command: int
) -> None:
    """One flag as written (``tokens`` from it to the end of its command, the script's
    ``command``-th) into ``found``."""
    token = tokens[0]
    flag = token.split("=", 1)[0]
    action = parser._option_string_actions[flag]
    segment = [token, *([] if "=" in token else _values(tokens[1:], action.nargs))]
    dest = action.dest
    written = segment if "=" not in token else [flag, token.split("=", 1)[1]]
    resolved = [written[0]]
    for word in written[1:]:
        settled = _resolve(word, assigned, environ)
        # An unquoted $VAR splits into words (a blend "0.3 a 0.7 b" is four values).
        resolved += _split(settled) if settled != word else [settled]
    shown = " ".join(resolved[1:])
    at = (found, dest, flag, shown, command)
    if any("$" in v or "`" in v for v in resolved[1:]):
        said = " ".join(written[1:])
        said = said if said == shown else f"{said}, that is {shown}"
        _record(*at, unresolved=f"the script sets it at run time ({said})")
        return
    if getattr(action.type, "__module__", "builtins") != "builtins":
        # Megatron-LM's own type (moe_freq_type evaluates its text): never run on the script's.
        found.as_text.add(dest)
        _record(*at, value=shown)
        return
    try:
        parsed, _ = parser.parse_known_args(resolved)
    except _Refusal as e:  # as read here: a misreading is as likely as a bad script
        _record(*at, refused=f"{flag} {shown}: Megatron-LM's parser would refuse it as read here ({e})")
        return
    if dest in vars(parsed):
        _record(*at, value=getattr(parsed, dest))


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


_UNSET = object()


def _record(
    found: ScriptArgs,
    dest: str,
    flag: str,
    shown: str,
    command: int,
    value=_UNSET,
    unresolved=None,
    refused=None,
):
    """One reading of an argument. Read again in the same command, the last one holds (as
    argparse takes it); read again with another value elsewhere (two branches, a second
    command in the script), it is no longer known which one runs: not compared."""
    before = found.written.get(dest)
    if before is not None and found.command.get(dest) == command and dest not in found.conflicting:
        for readings in (found.values, found.refused, found.unresolved):
            readings.pop(dest, None)
        before = None
    found.written[dest], found.command[dest] = shown, command
    if before is not None and before != shown:
        found.values.pop(dest, None)
        found.refused.pop(dest, None)
        found.unresolved[dest] = f"the script sets it more than once ({before}; {shown})"
        found.conflicting.add(dest)
        return
    if dest in found.conflicting:
        return
    if value is not _UNSET:
        found.values[dest], found.flags[dest] = value, flag
    if unresolved is not None:
        found.unresolved[dest] = unresolved
    if refused is not None:
        found.refused[dest] = refused


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- the comparison


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


# What the job's Python reports of itself: run with recovery.job_python, bounded by a timeout.
VERSIONS_SNIPPET = """
import json, importlib.metadata as m
found = {}
for key, dist in (("megatron_core", "megatron-core"), ("torch", "torch")):
    try:
        found[key] = m.version(dist)
    except m.PackageNotFoundError:
        found[key] = None
try:
    import torch
    found["cuda"] = torch.version.cuda
    found["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
except Exception:
    found["cuda"] = found["nccl"] = None
print(json.dumps(found))
"""


def job_versions(job_python: list[str], timeout_seconds: float) -> dict:
    """megatron-core, torch, CUDA and NCCL as the job's own Python reports them (the command
    that starts it: a venv's python, or srun into the job's container); ``{"error": why}`` if
    it cannot say."""
    output = process.capture([*job_python, "-c", VERSIONS_SNIPPET], timeout_seconds)
    if output.timed_out:
        return {"error": f"{job_python[0]} timed out after {timeout_seconds:.0f}s"}
    if output.exit_code != 0:
        last = (output.stderr.strip().splitlines() or [""])[-1]
        return {"error": f"{job_python[0]} exited {output.exit_code}: {last[:200]}"}
    try:
        found = json.loads(output.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"{job_python[0]} printed no versions"}
    return found if isinstance(found, dict) else {"error": f"{job_python[0]} printed no versions"}


# How long the job's Python may take to say its versions (recovery.job_python; srun may queue).
JOB_PYTHON_TIMEOUT_SECONDS = 120.0


def checkpoint_fit(
    profile, directory: Path, script: Path, environ: dict[str, str], versions: dict | None = None
) -> Compatibility:
    """``script`` (run in ``environ``) against the checkpoint in ``directory``: its saved args,
    the job's drilled layouts, and the relaunch environment's versions against the writer's when
    ``recovery.job_python`` says how to ask (``versions``: as an earlier comparison asked them;
    they do not change with the checkpoint)."""
    saved, writer = saved_args(directory)
    found = script_args(script, environ)
    recovery = getattr(profile, "recovery", None)
    if versions is None:
        versions = (
            job_versions(recovery.job_python, JOB_PYTHON_TIMEOUT_SECONDS)
            if recovery is not None and recovery.job_python
            else {"error": "not asked (recovery.job_python is not set)"}
        )
    return compare(
        layout.parse_iter_dir(Path(directory).name),
        saved,
        found,
        drilled_layouts(profile.job.save_dir),
        writer,
        versions,
    )
