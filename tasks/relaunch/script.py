"""The Megatron-LM flags a job's batch script writes, read as text, never run.

The script's tokens (``shlex``), its own scalar assignments and the environment the relaunch
inherits resolve ``$VAR`` and ``${VAR:-default}`` (a word that is only a variable, ``torchrun ...
$GPT_ARGS`` or ``eval "$CMD"``, is the words it holds); a value still holding a ``$`` or a
backtick (a positional parameter, a command substitution) is named as not compared, and so is
what a heredoc holds. Flags are recognised by Megatron-LM's own argument parser and typed by the
standard types it gives them, so ``--lr=6e-5`` and ``--lr 0.00006`` are the same; a flag
Megatron-LM types with its own code (``--moe-layer-freq "[0]*4"``, which it evaluates) is kept as
the text written, never run here. In one command the last of a repeated flag holds, as argparse
takes it.

This reading is a pre-check, and it reads for certain only what it can: a value the parser
would refuse, or two readings of one flag, is named, not typed. The authority is what
Megatron-LM prints at start (``tasks.relaunch.printed``). Only flags the script writes are read:
a flag a wrapper sets (or a default) is not seen here.
"""

import argparse
import logging
import re
import shlex
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from tasks.errors import unreadable
from tasks.storage.local import open_regular


class _Refusal(Exception):
    """argparse's error, as an exception: one bad value is reported, never an exit."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _Refusal(message)


# What megatron.training imports where it is installed and the parser never uses: NVIDIA
# ModelOpt's checkpoint hooks (megatron/training/checkpointing.py, and through them Hugging Face
# transformers), about 7 CPU-s of a recovery's start where Megatron-Bridge's dependencies are
# installed, for nothing an argument needs. Megatron takes a failed import as "not installed".
OPTIONAL_IMPORTS = ("modelopt",)


@contextmanager
def _not_importing(names: tuple[str, ...]):
    """While inside, importing one of ``names`` (not imported yet) fails as a missing package;
    afterwards the names import as before."""
    blocked = [name for name in names if name not in sys.modules]
    sys.modules.update(dict.fromkeys(blocked))
    try:
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name) is None:
                sys.modules.pop(name, None)


@cache
def megatron_parser() -> _Parser:
    """Megatron-LM's own argument parser (megatron.training.arguments), with no defaults: a
    parse yields exactly the flags it was given. Importing it takes seconds; done once. The
    import installs a handler on the root logger, writing INFO to stdout (which the CLI keeps
    for its answer), and warns of every missing GPU library: both are undone here."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with warnings.catch_warnings(), _not_importing(OPTIONAL_IMPORTS):
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments
    root.handlers[:], root.level = handlers, level
    parser = add_megatron_arguments(_Parser(allow_abbrev=False, add_help=False))
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return parser


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


# What ends one command and starts the next on the same line (the lexer's punctuation tokens).
_SEPARATORS = {";", "&", "&&", "|", "||", "|&", ";;", ";&", ";;&"}


def _script_lines(text: str) -> list[tuple[str, bool]]:
    """The script's lines, continued lines joined, each with whether it is a heredoc's body
    (what it holds is a file's or a command's input, not a command of the script)."""
    kept, ending = [], None
    for line in text.replace("\\\n", " ").splitlines():
        if ending is not None:
            if line.strip() == ending or line == ending:
                ending = None
            else:
                kept.append((line, True))
            continue
        kept.append((line, False))
        opened = _HEREDOC.search(_COMMENT.sub("", line))
        if opened:
            ending = opened[3]
    return kept


def mentions(text: str, name: str) -> bool:
    """Whether the script ``text`` names ``name`` (a variable: ``$NAME``, ``${NAME:-x}``, or as
    the word itself) outside its comments: in a command, or in what a heredoc holds."""
    word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])")
    return any(word.search(line if body else _COMMENT.sub("", line)) for line, body in _script_lines(text))


def _lines(text: str) -> list[list[str]]:
    """The script's commands, each as its tokens (continued lines joined, comments dropped: a
    ``#`` that starts a word, never one inside a path; a heredoc's body left out): a flag's
    values never run on into the next command, and commands one line holds (``a; b``, ``a &&
    b``, ``a | b``) are as many commands."""
    lines = []
    for line, body in _script_lines(text):
        if body:
            continue
        line = _DESCRIPTOR.sub(r"\1", _COMMENT.sub("", line))
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, ""
        try:
            tokens = _substitutions(list(lexer))
        except ValueError:  # a quote that spans lines: its words as they stand
            tokens = line.split()
        command: list[str] = []
        for token in tokens:
            if token in _SEPARATORS:
                lines.append(command)
                command = []
            else:
                command += _flag_words(token)
        lines.append(command)
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
