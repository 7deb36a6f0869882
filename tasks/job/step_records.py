"""Step records read back for validation: the recorder's JSON lines (written by
``ckptops_records.StepRecorder`` in the training job), or Megatron-LM's log.

Jobs without the recorder are covered by ``parse_megatron_log`` for what Megatron-LM's standard
log lines hold (no batch IDs there).
"""

import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from tasks.errors import Unreadable, UsageError, unreadable
from tasks.storage.local import open_regular, read_lines

_COLUMNS = (
    "iteration",
    "consumed",
    "lr",
    "loss",
    "grad_norm",
    "skipped",
    "nan",
    "step_seconds",
    "throughput",
    "peak_memory",
    "batch_position",
    "batch_count",
    "time",
    "nonfinite",  # 1 where the loss or the grad norm was there but not a finite number
    # The loss is the mean over the iterations after this one up to the row's: the row's
    # iteration - 1 for a step record; for a Megatron-LM log line, the previous line's iteration
    # (NaN where a log does not say: see parse_megatron_log).
    "loss_from",
    # The checkpoint the row's run loaded, as Megatron-LM's "successfully loaded checkpoint ...
    # at iteration N" line says; NaN where nothing says (step records, a log without the line).
    "loaded",
    # The unit in the last place a log printed the loss and grad norm in (4.742902E+00: 1e-6;
    # 1.410: 1e-3); 0 for step records, which hold the values in full.
    "loss_printed_unit",
    "grad_norm_printed_unit",
    # Megatron-LM's "skipped samples" (--iterations-to-skip: samples passed without training),
    # printed only once above 0: 0 where a log line lacks it, NaN for step records.
    "skipped_samples",
)
_PRINTED = re.compile(r"[-+]?\d*\.?(\d*)(?:[eE]([-+]?\d+))?")


@dataclass
class Steps:
    """Records as numpy columns (a million steps validate in seconds), in the order written.
    Missing numbers are NaN; ``batch_digest`` holds strings (None where absent)."""

    source: str
    kind: str  # "records" or "megatron-log"
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    batch_digest: np.ndarray = field(default_factory=lambda: np.array([], dtype=object))
    attempt: np.ndarray = field(default_factory=lambda: np.array([], dtype=object))  # empty for logs
    memory_kind: str | None = None
    throughput_unit: str = "tokens/s"  # or samples/s from Megatron-LM logs

    def __getattr__(self, name):
        columns = self.__dict__.get("columns", {})
        if name in columns:
            return columns[name]
        raise AttributeError(name)

    def __len__(self) -> int:
        return int(self.columns["iteration"].size) if "iteration" in self.columns else 0

    def take(self, rows: np.ndarray) -> "Steps":
        """These rows only (one attempt of a file that several attempts appended to)."""
        pick = lambda values: values[rows] if values.size else values  # noqa: E731
        return Steps(
            self.source,
            self.kind,
            {name: values[rows] for name, values in self.columns.items()},
            pick(self.batch_digest),
            pick(self.attempt),
            self.memory_kind,
            self.throughput_unit,
        )


def _as_columns(values: dict[str, list]) -> dict[str, np.ndarray]:
    """Lists (from log lines) as the float columns Steps holds."""
    arrays = {}
    for name in _COLUMNS:
        column = values[name]
        arrays[name] = np.array([np.nan if v is None else v for v in column], dtype=np.float64)
    arrays["iteration"] = arrays["iteration"].astype(np.int64)
    return arrays


def _record_schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("iteration", pa.int64()),
            ("consumed_samples", pa.float64()),
            ("lr", pa.float64()),
            ("loss", pa.float64()),
            ("grad_norm", pa.float64()),
            ("skipped", pa.float64()),
            ("nan", pa.float64()),
            ("step_seconds", pa.float64()),
            ("tokens_per_second", pa.float64()),
            ("peak_memory_bytes", pa.float64()),
            ("memory_kind", pa.string()),
            (
                "batch",
                pa.struct([("position", pa.float64()), ("count", pa.float64()), ("digest", pa.string())]),
            ),
            ("attempt", pa.string()),
            ("time", pa.float64()),
        ]
    )


_FIELDS = {
    "consumed": "consumed_samples",
    "throughput": "tokens_per_second",
    "peak_memory": "peak_memory_bytes",
}


def _table_to_steps(path: Path, table) -> Steps:
    import pyarrow as pa

    def column(name):
        return table.column(name).combine_chunks() if table.num_rows else pa.array([], type=pa.float64())

    columns = {}
    for name in _COLUMNS:
        if name in ("nonfinite", "loss_from", "loaded", "skipped_samples") or name.endswith("_printed_unit"):
            continue
        if name.startswith("batch_"):
            values = column("batch").field(name.removeprefix("batch_")) if table.num_rows else column("x")
        else:
            values = column(_FIELDS.get(name, name))
        columns[name] = values.to_numpy(zero_copy_only=False).astype(np.float64)
    missing = np.nonzero(np.isnan(columns["iteration"]))[0]
    if missing.size:
        raise UsageError(f"{path}: record {missing[0] + 1} has no iteration: not a step record")
    columns["iteration"] = columns["iteration"].astype(np.int64)
    columns["loss_from"] = (columns["iteration"] - 1).astype(np.float64)
    columns["loaded"] = np.full(columns["iteration"].size, np.nan)
    columns["skipped_samples"] = np.full(columns["iteration"].size, np.nan)
    columns["loss_printed_unit"] = columns["grad_norm_printed_unit"] = np.zeros(columns["iteration"].size)
    for name in ("skipped", "nan"):
        columns[name] = np.nan_to_num(columns[name])
    # A value that is there (not null) and not finite: Infinity or NaN as the recorder wrote it.
    present = [column(name).is_valid().to_numpy(zero_copy_only=False) for name in ("loss", "grad_norm")]
    columns["nonfinite"] = (
        (present[0] & ~np.isfinite(columns["loss"])) | (present[1] & ~np.isfinite(columns["grad_norm"]))
    ).astype(np.float64)
    digests = np.array(column("batch").field("digest").to_pylist() if table.num_rows else [], dtype=object)
    attempts = np.array(table.column("attempt").to_pylist() if table.num_rows else [], dtype=object)
    kinds = [k for k in table.column("memory_kind").to_pylist() if k] if table.num_rows else []
    return Steps(str(path), "records", columns, digests, attempts, memory_kind=kinds[-1] if kinds else None)


def _whole_lines(path: Path, size: int) -> int:
    """Where the last whole line ends: a torn last line (the writer died mid-line) is left out."""
    with open(path, "rb") as f:
        end = size
        while end > 0:
            start = max(0, end - (1 << 16))
            f.seek(start)
            at = f.read(end - start).rfind(b"\n")
            if at >= 0:
                return start + at + 1
            end = start
    return 0


def _load_records(path: Path) -> Steps:
    """Columns straight from the JSON lines with Arrow's reader (C++, several times faster than
    parsing line by line in Python: a million records in about three seconds here), from a memory
    map of the file: the records are never held in memory a second time."""
    import pyarrow as pa
    import pyarrow.json as pj

    options = pj.ParseOptions(explicit_schema=_record_schema(), unexpected_field_behavior="ignore")
    with pa.memory_map(str(path)) as source:
        buffer = source.read_buffer()
        try:
            return _table_to_steps(path, pj.read_json(pa.BufferReader(buffer), parse_options=options))
        except pa.ArrowInvalid:
            whole = buffer.slice(0, _whole_lines(path, buffer.size))
            try:  # a torn last line is forgiven, nothing else
                return _table_to_steps(path, pj.read_json(pa.BufferReader(whole), parse_options=options))
            except pa.ArrowInvalid as e:
                raise UsageError(f"{path}: not step records ({str(e).splitlines()[0]})") from None


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|(.*)")
# The time Megatron-LM prints before each iteration line: ``[2026-12-01 19:15:12.926090]``
# (0.19; older releases print whole seconds), the printing host's local time.
_STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\]\s*$")
# Numbers as Megatron-LM prints them, NaN and infinities included (%E prints NAN and INF).
_FIELD = re.compile(
    r"\s*([^|:]+?):\s*([-+]?(?:[0-9.]+(?:[eE][-+]?[0-9]+)?|nan|inf(?:inity)?))\s*", re.IGNORECASE
)
_MEMORY = re.compile(r"\(after (\d+) iterations\) memory \(MB\) \|.*?max allocated: ([0-9.]+)")
# Megatron-Bridge's report: torch's peak allocated bytes in decimal gigabytes (1e9), 5 digits.
_MEMORY_GB = re.compile(
    r"\(after (\d+) iterations\) memory \(GB\) \|.*?mem-max-allocated-gigabytes: ([0-9.]+(?:[eE][-+]?\d+)?)"
)
_LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")


def iteration_lines(text: str) -> int:
    """How many Megatron-LM iteration lines ``text`` holds."""
    return sum(1 for line in text.splitlines() if _ITERATION.search(line))


class _Run:
    """One run's iteration lines in a log, for the window each printed loss averages.

    Megatron-LM prints at each logged iteration the mean loss since the previous logged one.
    The first line of a run averages from the iteration it started at (0, or the checkpoint it
    loaded, if the log says); the second line is version-dependent (in 0.19 the accumulator is
    not reset after the first line, so it averages from the run's start), so its window is not
    known (NaN); every later line's starts at the line before it."""

    def __init__(self, start: int | None):
        self.start, self.previous, self.lines = start, None, 0

    def loss_from(self, iteration: int) -> float | None:
        if self.lines == 0:
            start = self.start if self.start is not None or iteration != 1 else 0
        elif self.lines == 1:
            start = None
        else:
            start = self.previous
        self.previous, self.lines = iteration, self.lines + 1
        return start


def _printed_unit(text: str | None) -> float:
    """The unit in the last place of a number as printed; 0 for NaN, infinities or nothing."""
    match = _PRINTED.fullmatch(text) if text else None
    if match is None:
        return 0.0
    return 10.0 ** (int(match[2] or 0) - len(match[1]))


def _line_time(before: str) -> float | None:
    """The iteration line's leading timestamp as seconds since the epoch (the host's local time,
    as Megatron-LM printed it), or None for a line without one."""
    stamp = _STAMP.search(before)
    if stamp is None:
        return None
    try:
        return datetime.fromisoformat(stamp[1]).timestamp()
    except ValueError:
        return None


def parse_megatron_log(path: Path, lines) -> Steps:
    """Megatron-LM's training-log lines (``iteration N/ M | consumed samples: ... |``) and its
    memory report lines (``[Rank r] (after N iterations) memory (MB) | ... max allocated: X``);
    Megatron-Bridge prints the same iteration lines and reports memory in decimal gigabytes
    (``memory (GB) | ... mem-max-allocated-gigabytes: X``).
    ``lines`` may be a file: it is read a line at a time.

    Throughput is samples/s, from every line's ``elapsed time per iteration (ms)`` and ``global
    batch size`` (validation turns it into tokens/s with the checkpoint's sequence length):
    Megatron-LM prints TFLOP/s only with ``--log-throughput``, from its own FLOP formula."""
    values: dict[str, list] = {name: [] for name in _COLUMNS}
    memory: dict[int, int] = {}
    run = _Run(None)
    for line in lines:
        found = _MEMORY.search(line)
        gigabytes = _MEMORY_GB.search(line) if found is None else None
        if gigabytes:
            memory[int(gigabytes[1])] = int(float(gigabytes[2]) * 1e9)
            line = line[: gigabytes.start()]
        if found:
            memory[int(found[1])] = int(float(found[2]) * 1024 * 1024)
            # Rank 0's report and the last rank's iteration line share one output: under load
            # the report lands on the end of an iteration line, which is still read.
            line = line[: found.start()]
        found = _LOADED.search(line)
        if found:
            run = _Run(int(found[1]))
            continue
        found = _ITERATION.search(line)
        if not found:
            continue
        iteration = int(found[1])
        if run.previous is not None and iteration <= run.previous:
            run = _Run(None)  # another run in the same file, from a start the log does not say
        values["loss_from"].append(run.loss_from(iteration))
        values["loaded"].append(run.start)
        fields, printed = {}, {}
        for part in found[2].split("|"):
            match = _FIELD.fullmatch(part)
            if match:
                fields[match[1].strip().lower()] = float(match[2])
                printed[match[1].strip().lower()] = match[2]
        elapsed = fields.get("elapsed time per iteration (ms)")
        batch = fields.get("global batch size")
        loss, grad_norm = fields.get("lm loss"), fields.get("grad norm")
        values["iteration"].append(iteration)
        values["consumed"].append(fields.get("consumed samples"))
        values["lr"].append(fields.get("learning rate"))
        values["loss"].append(loss)
        values["grad_norm"].append(grad_norm)
        values["loss_printed_unit"].append(_printed_unit(printed.get("lm loss")))
        values["grad_norm_printed_unit"].append(_printed_unit(printed.get("grad norm")))
        values["skipped"].append(fields.get("number of skipped iterations", 0))
        values["nan"].append(fields.get("number of nan iterations", 0))
        values["skipped_samples"].append(fields.get("skipped samples", 0))
        values["step_seconds"].append(elapsed / 1000 if elapsed is not None else None)
        values["throughput"].append(batch / (elapsed / 1000) if batch and elapsed else None)
        values["peak_memory"].append(None)
        values["batch_position"].append(None)
        values["batch_count"].append(batch)
        values["time"].append(_line_time(line[: found.start()]))
        values["nonfinite"].append(
            float(any(v is not None and not math.isfinite(v) for v in (loss, grad_norm)))
        )
    # Megatron reports memory once, after the first iterations: it holds for the first logged
    # iteration at or after the report.
    for reported, value in memory.items():
        later = [i for i, it in enumerate(values["iteration"]) if it >= reported]
        if later:
            values["peak_memory"][later[0]] = value
    return Steps(
        str(path),
        "megatron-log",
        _as_columns(values),
        np.array([None] * len(values["iteration"]), dtype=object),
        memory_kind="cuda_max_allocated",
        throughput_unit="samples/s",
    )


def is_step_records(path: Path) -> bool:
    """Whether ``path`` holds step records (JSON lines, a recorder's) rather than a log: told
    by its first meaningful line (False for an empty file)."""
    first = next((line for line in read_lines(path, 4096) if line.strip()), "")
    return first.lstrip().startswith("{")


def load_steps(path: Path, start: int = 0) -> Steps:
    """Step records or a Megatron-LM log, told apart by their first meaningful line; either is
    read without holding the file in memory whole (a FIFO or a device is refused). ``start``: a
    log's lines from that byte on (a relaunch's, in an output file earlier runs wrote)."""
    path = Path(path)
    try:
        if not start and is_step_records(path):
            return _load_records(path)
        steps = parse_megatron_log(path, read_lines(path, start=start))
    except OSError as e:
        raise unreadable(path, e) from None
    if not len(steps):
        raise UsageError(f"{path}: neither step records nor Megatron-LM log lines")
    return steps


def configured(profile) -> Path | None:
    """Where the profile says the job's step records (or its Megatron log) are: the one place
    that setting is read (recovery, the continuation drill, goodput and adoption ask here)."""
    return profile.recovery.step_records if profile.recovery else None


def read_configured(records: Path | None) -> Steps | None:
    """The job's step records: a configured path must be a file (nothing is relaunched that
    could never be watched or validated); one without a record yet holds no steps."""
    if records is None:
        return None
    try:
        open_regular(records).close()
    except (UsageError, Unreadable) as e:
        raise type(e)(
            f"recovery.step_records: {e}; a relaunch could neither be watched nor validated"
        ) from None
    if Path(records).stat().st_size == 0:
        return None
    return load_steps(records)
