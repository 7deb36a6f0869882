"""One policy for the bytes ckptops reads and did not write: ``.metadata``, common state,
``train_state.pt``, ``run_config.yaml``, Flight Recorder dumps, logs, histories, profiles.

- only a regular file is read (``open_regular``: a FIFO would block for ever, a device never
  ends), and where the name must be the file itself, not through a link (``follow=False``);
- its size is bounded before it is read (``read_bounded``), and so are the structures parsed
  from it: nesting depth (``load_json``, ``load_yaml``), and the integers that size what comes
  next (``bounded_int``);
- a violation is one ``Malformed`` line naming the file, the key where there is one, and the
  limit: never a traceback, never a hang.

Each reader passes its own limits, set by what the checkpoint's own files make possible (a
record no larger than the bytes that hold it, a chunk no larger than its tensor).
"""

import json
import os
from pathlib import Path
from typing import Any

import yaml

from tasks.errors import Malformed
from tasks.storage.local import open_regular

# Deeper than any file ckptops reads needs (a Bridge run_config nests about 6 levels, a Flight
# Recorder dump 5), far below where Python's parsers run out of stack.
MAX_DEPTH = 64
_PIECE = 8 << 20  # read in pieces of 8 MiB


def read_bounded(path: Path, limit: int, what: str, follow: bool = True) -> bytes:
    """The whole of the regular file ``path``, refused past ``limit`` bytes (``what`` names it in
    the message). The opened descriptor's size is asked first (a read of ``limit + 1`` would
    reserve that much memory before a byte came), and what is read through it is counted: a file
    still growing is refused the same way."""
    with open_regular(path, follow=follow) as f:
        data = bytearray()
        if os.fstat(f.fileno()).st_size <= limit:
            while len(data) <= limit and (piece := f.read(min(_PIECE, limit + 1 - len(data)))):
                data += piece
        if os.fstat(f.fileno()).st_size > limit or len(data) > limit:
            raise Malformed(f"{path}: {what} is larger than {limit:,} bytes, the most ckptops reads; refused")
    return bytes(data)


def load_json(data: bytes | str, path: Path, what: str, depth: int = MAX_DEPTH) -> Any:
    """``data`` (the bytes of ``path``) as JSON, nested at most ``depth`` deep."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise Malformed(f"{path}: {what} nests deeper than {depth} levels; refused") from None
    except (ValueError, TypeError) as e:
        raise Malformed(f"{path}: {what} is not JSON ({e})") from None
    check_depth(value, path, what, depth)
    return value


def load_yaml(data: bytes | str, path: Path, what: str, depth: int = MAX_DEPTH) -> Any:
    """``data`` (the bytes of ``path``) as YAML (the safe loader), nested at most ``depth`` deep."""
    try:
        _yaml_nesting(data, path, what, depth)
        value = yaml.safe_load(data)
    except RecursionError:
        raise Malformed(f"{path}: {what} nests deeper than {depth} levels; refused") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise Malformed(f"{path}: {what} is not YAML{at} ({getattr(e, 'problem', None) or e})") from None
    check_depth(value, path, what, depth)
    return value


def _yaml_nesting(data: bytes | str, path: Path, what: str, depth: int) -> None:
    """Refuse YAML nested deeper than ``depth`` from its parser's events, before anything is
    built: the events come without recursion, and the refusal comes at the first level too deep
    (building first would cost seconds of a 50 kB file of brackets)."""
    level = 0
    for event in yaml.parse(data, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            level += 1
            if level > depth:
                raise Malformed(f"{path}: {what} nests deeper than {depth} levels; refused")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            level -= 1


def check_depth(value: Any, path: Path, what: str, depth: int = MAX_DEPTH) -> None:
    """Refuse a parsed ``value`` nested deeper than ``depth``. Walked without recursion, each
    container once (YAML's aliases share one object: a billion laughs is walked once)."""
    seen: set[int] = set()
    pending = [(value, 1)]
    while pending:
        item, level = pending.pop()
        if not isinstance(item, (dict, list, tuple)) or id(item) in seen:
            continue
        if level > depth:
            raise Malformed(f"{path}: {what} nests deeper than {depth} levels; refused")
        seen.add(id(item))
        children = item.values() if isinstance(item, dict) else item
        pending.extend((child, level + 1) for child in children)


def bounded_int(value: Any, path: Path, key: str, low: int, high: int) -> int:
    """``value`` (``key`` of ``path``) as an int within ``[low, high]``; refused otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise Malformed(f"{path}: {key} is {str(value)[:40]!r}, not an integer")
    if not low <= value <= high:
        # An integer of thousands of digits cannot even be printed (Python's limit): its size is.
        said = value if value.bit_length() <= 64 else f"a {value.bit_length()}-bit integer"
        raise Malformed(f"{path}: {key} is {said}, outside {low}..{high:,}; refused")
    return value
