"""The job's arguments as Megatron-LM itself parsed them: the block it prints at start-up.

Megatron-LM's rank 0 prints every argument once validated (``_print_args`` in
megatron/training/arguments.py), before it builds the model or loads anything::

    ------------------------ arguments ------------------------
      num_layers ...................................... 4
      save ............................................ /ckpt/job
    -------------------- end of arguments ---------------------

That block is the authority on what a relaunch or a continuation runs with: whatever wrapper,
``eval``, heredoc or config file set the flags, it says the values Megatron-LM took (those of
``--use-checkpoint-args`` among them). It is read as text, never evaluated: the name is the
argument's ``dest``, its value ``str()`` of what Megatron-LM holds. A value is typed only where
``ast.literal_eval`` reads it (numbers, booleans, None, a printed list), bounded in length; any
other value is compared as the text Megatron-LM printed.

A log is read as it is being written, by anyone: a line may carry ``srun --label``'s ``N: ``,
a timestamp, or come from another rank between two of rank 0's; bytes that do not decode are
replaced. The block counts only once its closing line is there (``tasks.relaunch.launch``
watches for it while the run starts).
"""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from tasks.checkpoint import dialect, layout
from tasks.checkpoint.facts import saved_args
from tasks.checkpoint.manifest import UNCHECKED
from tasks.checkpoint.signing import Trust
from tasks.errors import unreadable
from tasks.relaunch.fit import KIND_OF, Compatibility, Difference, Kind, compare
from tasks.relaunch.script import ScriptArgs

_OPEN = re.compile(r"-{8,} arguments -{8,}\s*$")
_CLOSE = re.compile(r"-{8,} end of arguments -{8,}\s*$")
# "  name <dots> value": the dots pad the name to 48 characters (none for a longer name).
_ARG = re.compile(r"  ([A-Za-z_][A-Za-z0-9_]*) (\.*) (.*)$")
_LABEL = re.compile(r"(\d+): ?$")  # srun --label's "N: " just before the text
_WIDTH = 48
# Past this a printed value is compared as text, never parsed (a list of every layer's pattern).
_TYPED_CHARACTERS = 10_000
# The most of a log read for the block: Megatron-LM prints it before anything else of size.
_READ_LIMIT = 64 << 20


@dataclass
class PrintedArgs:
    """Megatron-LM's printed arguments: ``values`` by argument name (its ``dest``), each as the
    text printed; ``path`` the log, ``line`` the block's opening line (1-based)."""

    values: dict[str, str]
    path: Path
    line: int

    def get(self, name: str) -> str | None:
        return self.values.get(name)

    def typed(self, name: str):
        """``name``'s value as Python reads its printed text (None when not printed)."""
        text = self.values.get(name)
        return None if text is None else typed(text)

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def typed(text: str):
    """A printed value as a literal (``4``, ``6e-05``, ``True``, ``None``, ``['a', 'b']``), else
    its text: never evaluated, and a long one not even parsed."""
    if len(text) > _TYPED_CHARACTERS:
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _argument(line: str, label: str | None) -> tuple[str, str] | None:
    for match in _ARG.finditer(line):
        name, dots, value = match.groups()
        if len(name) + len(dots) != max(_WIDTH, len(name)):
            continue
        if label is not None:
            own = _LABEL.search(line[: match.start()])
            if own is not None and own.group(1) != label:
                continue  # another rank's line that happens to look like one
        return name, value.rstrip("\r")
    return None


def read_printed_args(path: Path, start: int = 0) -> PrintedArgs | None:
    """The first complete arguments block in the log at ``path`` (from byte ``start``: a
    relaunch appending to the job's log), or None while there is none (the log not there yet,
    or still being written)."""
    path = Path(path)
    try:
        with open(path, "rb") as log:
            log.seek(start)
            return _block(log, path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise unreadable(path, e) from None


def _block(log, path: Path) -> PrintedArgs | None:
    values: dict[str, str] | None = None
    opened, label, read, bridge = 0, None, 0, None
    for number, raw in enumerate(log, start=1):
        read += len(raw)
        if read > _READ_LIMIT or not raw.endswith(b"\n"):
            return None  # a line still being written, or no block where Megatron-LM prints it
        line = raw.decode(errors="replace").rstrip("\n")
        if values is None:
            found = _OPEN.search(line) or _BRIDGE_OPEN.search(line)
            if found is not None:
                values, opened = {}, number
                bridge = _BridgeBlock() if found.re is _BRIDGE_OPEN else None
                own = _LABEL.search(line[: found.start()])
                label = own.group(1) if own else None
            continue
        if bridge is not None:
            if bridge.read(line, values):
                return PrintedArgs(values, path, opened)
            continue
        if _CLOSE.search(line):
            return PrintedArgs(values, path, opened)
        argument = _argument(line, label)
        if argument is not None:
            values.setdefault(*argument)
    return None


# Megatron-Bridge prints no arguments block: its setup logs a "Configuration Summary" instead
# (ConfigContainer.log_non_default_values, 0.4-0.6): for the model, optimizer and DDP configs the
# values that differ from Megatron-Core's defaults (``  name: repr  (Mcore default: repr)``), for
# the others every value set (``  name: repr``), under ``[section]`` headers, closed by a rule.
_BRIDGE_OPEN = re.compile(r"Configuration Summary \(Non-Default Values vs Megatron Core\)\s*$")
_BRIDGE_SECTION = re.compile(r"^\[(\w+)\]")
_BRIDGE_VALUE = re.compile(r"^  (\w+): (.*?)(?:  \(Mcore default: .*\))?\s*$")
_BRIDGE_RULE = re.compile(r"^={20,}\s*$")
_SRUN_LABEL = re.compile(r"^\s*\d+: ")


class _BridgeBlock:
    """Bridge's summary read a line at a time, its values under Megatron-LM's argument names
    (``dialect.megatron_name``); a value equal to Megatron-Core's default is not printed, so not
    compared."""

    def __init__(self):
        self.section: str | None = None
        self.started = False

    def read(self, line: str, values: dict[str, str]) -> bool:
        """Takes one line (``srun --label``'s ``N: `` dropped); True once the block has closed."""
        line = _SRUN_LABEL.sub("", line, count=1)
        if _BRIDGE_RULE.match(line):
            return self.started  # the rule under the title opens it, the last one closes it
        self.started = True
        section = _BRIDGE_SECTION.match(line)
        if section is not None:
            self.section = section.group(1)
            return False
        value = _BRIDGE_VALUE.match(line)
        name = dialect.megatron_name(self.section, value.group(1)) if value and self.section else None
        if name is not None:
            text = value.group(2)  # a repr: a string's quotes go, as Megatron-LM prints it
            values.setdefault(name, found if isinstance(found := typed(text), str) else text)
        return False


# Arguments that mean something only with a switch on: without it Megatron-LM overwrites them
# after printing (num_query_groups becomes the head count in its FLOPs count, and is saved so).
_ONLY_WITH = {"num_query_groups": "group_query_attention"}
# Arguments whose printed value is a path: relative ones are the job's working directory's.
_PATHS = {
    "data_path",
    "train_data_path",
    "data_args_path",
    "per_split_data_args_path",
    "tokenizer_model",
    "vocab_file",
    "merge_file",
}


def _resolved(value, cwd: Path | None):
    """A path argument as the job opens it: a relative path from its working directory."""
    if cwd is None:
        return value
    one = lambda v: str(Path(cwd, v).resolve()) if isinstance(v, str) and "/" in v else v  # noqa: E731
    return [one(v) for v in value] if isinstance(value, list) else one(value)


def fit_printed(
    printed: PrintedArgs,
    checkpoint_dir: Path,
    drilled: dict[tuple[int, int], str],
    cwd: Path | None = None,
    trust: Trust = UNCHECKED,
) -> Compatibility:
    """What Megatron-LM printed against the arguments the checkpoint in ``checkpoint_dir``
    saved, by ``tasks.relaunch.fit``'s rules (architecture and vocabulary refused, layout only
    onto one of the ``drilled`` layouts and approved, data, precision and load switches approved,
    optimizer warned). Every argument of the rules is printed, so each is compared; ``cwd``, the
    job's working directory, resolves relative paths on both sides. A value Megatron-LM printed as
    None that the checkpoint holds is one it sets later (``num_query_groups`` in its FLOPs
    count): not compared. ``trust``: the job's signing policy, the checkpoint's manifest read
    under it first."""
    saved, _ = saved_args(checkpoint_dir, trust)
    found = ScriptArgs(printed.path)
    later: list[Difference] = []
    for name in sorted(set(printed.values) & set(KIND_OF)):
        value = printed.typed(name)
        before = getattr(saved, name, None)
        switch = _ONLY_WITH.get(name)
        if switch is not None and printed.typed(switch) is not True:
            continue
        if value is None and before is not None:
            said = f"{name}: Megatron-LM printed None, the checkpoint holds {before}: not compared"
            later.append(Difference(name, Kind.NOTE, said))
            continue
        if name in _PATHS and hasattr(saved, name):
            value, before = _resolved(value, cwd), _resolved(before, cwd)
            if str(value) == str(before):
                value = getattr(saved, name)
        found.values[name], found.flags[name] = value, f"{name} (printed at {printed.where()})"
    fit = compare(layout.parse_iter_dir(Path(checkpoint_dir).name), saved, found, drilled)
    fit.differences += later
    return fit
