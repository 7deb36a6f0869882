"""Triage of a failed distributed training run from its logs: what class of failure, which nodes
to suspect, and the first line that shows it. A pure function of the log files (read streaming,
line by line: logs can be GBs) and of what the caller knows (the rank -> node layout, the exit code).

Every line is one of: a *root* cause (the class it is evidence for: hardware, network, numerics,
oom, software, preempted), a *cascade* (a consequence of some other rank's failure: a collective
timeout, a closed connection, an exited task, SIGTERM sent to the workers; class ``hang``), or
nothing. The decision:

1. Hardware evidence anywhere wins, even when it is not the earliest line: a GPU fault often shows
   first as an illegal memory access or an NCCL error on the training side, and as a critical XID
   only in the node's kernel log.
2. Megatron's exit code 17 (its result validation failed) means numerics, unless (1).
3. Otherwise the class of the earliest root line. Lines are ordered by timestamp across files;
   a line without one inherits the last timestamp of its file (a traceback below a timestamped
   line), lines before a file's first timestamp take that first one, and a line is never placed
   before an earlier line of its own file (ranks interleaved in one file with skewed clocks). A
   file with no timestamp at all cannot be placed in time: its lines come first, in the order the
   files were given (a rank that died with a bare Python traceback is usually the one that failed).
   dmesg's ``[ 219.470994]`` is uptime, not wall time, and is not a timestamp here.
4. Only cascades: ``hang``.
5. Nothing recognised: ``unknown``. No guessing.

Within a class, the first error of a preempted job is the scheduler's line that states why (``DUE
TO TIME LIMIT``), if there is one. A step cancelled without a reason after an srun task failed is
``srun --kill-on-bad-exit`` at work, a cascade. DeepSpeed's fp16 overflows are numerics at five in
a row only once the loss scale is down to OVERFLOW_SCALE_FLOOR: the initial loss-scale search from
2^16..2^32 overflows many times in a row and is normal.

Suspect nodes come only from the root lines of the chosen class (never from cascades: the rank
whose collective timed out is a victim), except for a hang where one task exited before the
timeouts (that task's node), and for a task that exited with Megatron's 16 or 17. A preempted job
has no suspects (a preempted node is not faulty), unless Slurm says NODE FAILURE.

Timestamps are taken as UTC. Formats without a year (glog ``E0817 17:40:34``, syslog
``Dec  2 11:38:47``) take the year of the first dated timestamp in any of the files, else the
current year (the previous one for a date later than today).
"""

import bisect
import calendar
import re
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tasks.errors import UsageError, unreadable
from tasks.health.xids import CRITICAL_XIDS
from tasks.storage.local import read_lines

_FRAME = re.compile(r'\bFile "[^"]+", line \d+')

CLASSES = ("hardware", "network", "numerics", "oom", "software", "hang", "preempted", "unknown")

APPLICATION_XIDS = frozenset({13, 31, 43})  # an application fault: evidence for software
EVIDENCE_CAP = 50
# What is kept of a log line: an error message is at its start, and a first error is stored in
# the incident ledger and in every JSON answer.
LINE_BYTES = 4096
_BLOCK = 1000  # lines screened at once
SPIKE_WINDOW, SPIKE_FACTOR = 20, 3.0
OVERFLOWS_FOR_NUMERICS = 5
OVERFLOW_SCALE_FLOOR = 256.0  # a loss scale this low after 5 overflows in a row: not the initial search
MEGATRON = {16: "exclude-node-and-rerun", 17: "stop"}


@dataclass(frozen=True)
class Line:
    """One classified log line."""

    file: str
    line: int  # 1-based
    text: str  # without the trailing newline
    kind: str  # "root", "cascade" or "info"
    cls: str  # the class this line is evidence for ("hang" for cascades)
    at: float | None  # its timestamp (own or inherited from above), epoch seconds
    nodes: tuple[str, ...] = ()  # the nodes this line names as suspects


@dataclass
class Triage:
    cls: str
    suspect_nodes: list[str]
    first_error: Line | None
    evidence: list[Line]
    reason: str
    exit_code: int | None = None
    megatron: str | None = None
    iteration: int | None = None
    anomaly_iteration: int | None = None

    def to_dict(self) -> dict:
        first = self.first_error
        return {
            "class": self.cls,
            "suspect_nodes": list(self.suspect_nodes),
            "first_error": None
            if first is None
            else {"file": first.file, "line": first.line, "text": first.text},
            # The first error is evidence too; its text is given once, above.
            "evidence": [
                {"file": e.file, "line": e.line, "class": e.cls, "kind": e.kind}
                | ({"first_error": True} if e == first else {"text": e.text})
                for e in self.evidence
            ],
            "reason": self.reason,
            "exit_code": self.exit_code,
            "megatron": self.megatron,
            "iteration": self.iteration,
            "anomaly_iteration": self.anomaly_iteration,
        }

    def line(self) -> str:
        """One line for a human, the class word first."""
        parts = [self.cls, f"suspects {', '.join(self.suspect_nodes) or 'none'}"]
        first = self.first_error
        parts.append(
            f"first error: {first.file}:{first.line}: {first.text.strip()[:240]}"
            if first
            else "no recognised error"
        )
        if self.megatron:
            parts.append(f"megatron: {self.megatron} (exit {self.exit_code})")
        if self.iteration is not None:
            parts.append(f"iteration {self.iteration}")
        return "  ".join(parts)


# Timestamps. The leftmost one on a line counts.
_MON = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
_MONTHS = {m: i for i, m in enumerate(_MON.split("|"), 1)}
_TS = re.compile(
    r"(?P<iso>(?P<Y>(?:19|20)\d\d)[-/](?P<m>\d\d)[-/](?P<d>\d\d)[T _]"
    r"(?P<H>\d\d):(?P<M>\d\d):(?P<S>\d\d(?:[.,]\d+)?))"
    rf"|(?P<ct>\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?P<cb>{_MON}) +(?P<cd>\d\d?) "
    r"(?P<cH>\d\d):(?P<cM>\d\d):(?P<cS>\d\d) (?P<cY>\d{4}))"
    rf"|(?P<sy>\b(?P<sb>{_MON}) +(?P<sd>\d\d?) (?P<sH>\d\d):(?P<sM>\d\d):(?P<sS>\d\d(?:\.\d+)?))"
    r"|(?P<gl>(?<![\w.])[IWEF](?P<gmd>\d{3,4}) (?P<gH>\d\d):(?P<gM>\d\d):(?P<gS>\d\d(?:\.\d+)?))"
    r"|(?P<sk>(?<![\w.])[IWEF] (?P<km>\d\d)-(?P<kd>\d\d) (?P<kH>\d\d):(?P<kM>\d\d):(?P<kS>\d\d))"
)

_TS_SCREEN = re.compile(r"\d:\d\d:\d\d")

# Words one of which every line that can be evidence holds (lowercased): most lines of a big log
# hold none and skip the classifier.
_SCREEN = (
    "err", "fail", "xid", "ecc", "bus", "memory", "alloc", "nan", "overflow", "minimum", "diverged",
    "cancelled", "preempt", "requeu", "terminat", "timeout", "timed out", "closed", "exception",
    "assert", "abort", "signal", "exited", "stuck", "lost", "dbe", "segmentation", "sigsegv", "killed",
    "oom", "remote", "completion", "async", "exhausted", "reset by", "uncorrectable", "exceeded",
    "interruption", "status_", "what()", "watchdog", "process down", "unexpected", "sigusr", "requeing",
)  # fmt: skip


def _screened(text: str) -> bool:
    low = text.lower()
    if "inf" in low and ("loss" in low or "grad" in low or "result" in low):
        return True
    return any(word in low for word in _SCREEN)


# Root causes, in the order a line is tested.
_XID = re.compile(r"\bXid\b(?:\s*\(PCI:[^)]*\))?\s*[:,]?\s*(\d+)", re.I)
_XID_CAUSE = re.compile(r"caused by previous Xid (\d+)", re.I)
_HARDWARE = re.compile(
    r"uncorrectable ECC|ECC_UNCORRECTABLE|ErrorECCUncorrectable|returned error 214\b|CUDA error 214\b"
    r"|double[- ]bit (?:ECC )?error|\(DBE\)|fallen off the bus|GPU is lost|uncorrectable NVLink"
    r"|row remapping failure",
    re.I,
)
_OOM = re.compile(
    r"CUDA out of memory|OutOfMemoryError|\bTried to allocate\b|Failed to CUDA calloc|cudaMalloc\w* failed"
    r"|Cuda failure (?:\d+ )?'out of memory'|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation"
    r"|CUDA error: out of memory|NCCL WARN.*\bout of memory\b|RESOURCE_EXHAUSTED"
    r"|Out of memory: Kill(?:ed)? process|invoked oom-killer"
)
_IB_ASYNC = re.compile(r"Got async (?:error )?event\s*:\s*(.*)", re.I)
_IB_BENIGN = re.compile(r"port active|GID table change|LID change|SM change|client reregister", re.I)
_NETWORK = re.compile(
    r"NET/IB\s*:?.*\bGot completion from peer\b|\bncclRemoteError\b|NET/IB\s*:.*\b(?:error|failed|failure)\b"
    r"|IBV_WC_\w+_ERR|retry counter exceeded|Call to ibv_\w+ failed"
)
_NCCL_SYSTEM = re.compile(r"ncclSystemError|unhandled system error")
_NUMERICS = re.compile(
    r"Unexpected result\b|found (?:NaN|Inf) in local grad norm"
    r"|(?<![A-Za-z])loss'? ?(?:is|=|of)\s*'?(?:nan|inf)\b"
    r"|\bgrad(?:ient)?[ _]norm'?(?: is|:|=)?\s*'?(?:nan|inf)\b|(?<![A-Za-z])loss'?[:=]?\s*'?(?:nan|inf)\b"
    r"|loss scale already at minimum|Minimum loss scale reached|Model diverged"
    r"|number of nan iterations:\s*[1-9]|NaN or Inf found in input tensor"
    r"|\b(?:nan|inf) (?:loss|gradients?) detected",
    re.I,
)
_CANCELLED = re.compile(
    r"\*\*\* (?:JOB|STEP) \S+ ON (?P<host>\S+) CANCELLED AT \S+(?: DUE TO (?P<why>[A-Z][A-Z ]*?))? \*\*\*"
)
_NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")
_PREEMPTED = re.compile(
    r"this job is preempted|\b(?:was|is|been|got) preempted\b|preemption notice|termination is imminent"
    r"|spot (?:instance )?(?:interruption|termination)|[Rr]eque(?:u?e|ued|u?ing) (?:SLURM |the )?job"
    r"|auto-requeue|\bSIGUSR[12]\b"
)
_SOFTWARE = re.compile(
    r"(?<![\w.])(?<!except )(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception)|Exception)(?::\s|:$)"
    r"|CUDA error: |CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|device-side assert|Assertion `.*` failed"
    r"|Segmentation fault|\(SIGSEGV\)"
)

# A CUDA failure reported through NCCL: this rank's own error, even inside a DistBackendError.
_CUDA_FAILURE = re.compile(r"Cuda failure (?:\d+ )?'|unhandled cuda error|ncclUnhandledCudaError")

# Consequences of another rank's failure.
_WRAPPED = re.compile(
    r"(?:watchdog thread terminated with exception|found async exception when checking for NCCL errors"
    r"|what\(\)):\s*(.*)"
)
_SRUN_EXIT = re.compile(
    r"srun: error: (?P<node>[^\s:]+): (?P<n>tasks?) (?P<tasks>[\d,\-\[\]]+): "
    r"(?:Exited with exit code (?P<code>\d+)|Terminated|Killed)"
)
_CASCADE = re.compile(
    r"Watchdog caught collective operation timeout|Heartbeat monitor timed out|watchdog got stuck"
    r"|detected by watchdog|Timeout at NCCL work|Some NCCL operations have failed or timed out"
    r"|taking the entire process down|wait timeout after|Timed out waiting|Received a dump signal"
    r"|DistBackendError|DistStoreError|DistNetworkError|ChildFailedError|SignalException|ProcessExitedException"
    r"|Connection closed by (?:remote )?peer|Connection closed by localRank|Connection reset by peer"
    r"|remote process exited|NCCL communicator was aborted|Socket recv failed"
    r"|Sending process \d+ closing signal|Received SIGTERM|failed \(exitcode: "
)
_TIMEOUT = re.compile(r"time[d ]?out|timeout|got stuck", re.I)

# Where a line names its node or rank.
_MEGATRON_NODE = re.compile(r"\bRank -?\d+, node ([^\s,]+), device\b")
_NCCL_HOST = re.compile(r"(?:^|(?<=[\s\]>]))([A-Za-z0-9][\w.-]*):\d+:\d+ \[\d+\]")
_KERNEL_HOST = re.compile(
    rf"^(?:(?:{_MON}) +\d\d? \d\d:\d\d:\d\d(?:\.\d+)?Z?"
    r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?)\s+(\S+)\s+(?:kernel|[\w.-]+\[\d+\]):"
    r"|^(\S+): kern:"
)
_MILABENCH = re.compile(r"^[^\s.]+\.(\S+) \[std(?:err|out)\]")
_RANK = (re.compile(r"\[rank(\d+)\]:"), re.compile(r"^(\d+): "), re.compile(r"\bRank (\d+)\b"))

# Progress lines.
_MEGATRON_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
_MEGATRON_LOSS = re.compile(r"\blm loss:\s*([-+\w.]+)")
_MEGATRON_GRAD = re.compile(r"\bgrad norm:\s*([-+\w.]+)")
_MEGATRON_SKIPPED = re.compile(r"number of skipped iterations:\s*(\d+)")
_MEGATRON_NANS = re.compile(r"number of nan iterations:\s*(\d+)")
_LOCAL_ITER = re.compile(r"\biteration (\d+) consumed \d+ lr \S+ loss (\S+) grad_norm (\S+)")
_NANOGPT_ITER = re.compile(r"\biter (\d+): loss ([-+\w.]+)")
_EXPLICIT_ITER = re.compile(r"\biteration (-?\d+): Unexpected result")
_OVERFLOW = re.compile(
    r"OVERFLOW!.*Skipping step(?:.*Attempted loss scale:\s*(\S+?),\s*reducing to\s*(\S+))?"
)
_NVRM_CONTINUATION = re.compile(r"^\s+NVRM: ")


def _number(text: str) -> float | None:
    try:
        return float(text.rstrip(",|"))
    except ValueError:
        return None


def _median(values) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _finite(value: float | None) -> bool:
    return value is not None and value == value and abs(value) != float("inf")


@dataclass
class _Hit:
    """A root or cascade line while the files are read; its time is resolved at the end, when the
    year for timestamps without one is known."""

    file_index: int
    file: str
    line: int
    text: str
    kind: str
    cls: str
    ts: tuple | None  # (year or None, month, day, hour, minute, second)
    nodes: tuple[str, ...] = ()
    tags: frozenset = frozenset()
    anomaly: int | None = None
    exit_code: int | None = None
    order: tuple | None = None  # filled in at the end
    at: float | None = None

    def to_line(self, at: float | None) -> Line:
        return Line(self.file, self.line, self.text, self.kind, self.cls, at, self.nodes)


def _timestamp(text: str) -> tuple | None:
    if _TS_SCREEN.search(text) is None:  # much cheaper than _TS on the lines without one
        return None
    m = _TS.search(text)
    if not m:
        return None
    kind, g = m.lastgroup, m.group
    if kind == "iso":
        stamp = (int(g("Y")), int(g("m")), int(g("d")), int(g("H")), int(g("M")), g("S"))
    elif kind == "ct":
        stamp = (int(g("cY")), _MONTHS[g("cb")], int(g("cd")), int(g("cH")), int(g("cM")), g("cS"))
    elif kind == "sy":
        stamp = (None, _MONTHS[g("sb")], int(g("sd")), int(g("sH")), int(g("sM")), g("sS"))
    elif kind == "gl":
        md = g("gmd")
        stamp = (None, int(md[:-2]), int(md[-2:]), int(g("gH")), int(g("gM")), g("gS"))
    else:
        stamp = (None, int(g("km")), int(g("kd")), int(g("kH")), int(g("kM")), g("kS"))
    year, month, day, hour, minute, second = stamp
    second = float(second.replace(",", "."))
    if not (1 <= month <= 12 and 1 <= day <= 31 and hour < 24 and minute < 60 and second < 61):
        return None
    return year, month, day, hour, minute, second


def _epoch(stamp: tuple, year: int) -> float:
    y, month, day, hour, minute, second = stamp
    whole = int(second)
    return calendar.timegm((y or year, month, day, hour, minute, whole, 0, 0, 0)) + (second - whole)


def _rank(text: str) -> int | None:
    for pattern in _RANK:
        m = pattern.search(text)
        if m:
            return int(m[1])
    return None


def _nodes(text: str, layout: dict[int, str]) -> tuple[str, ...]:
    """The node a root line names: Megatron's ``node N``, NCCL's ``host:pid:tid [gpu]``, a kernel
    log's host, a launcher's ``bench.node [stderr]``, else its rank through the layout."""
    for pattern in (_MEGATRON_NODE, _NCCL_HOST, _KERNEL_HOST, _MILABENCH):
        m = pattern.search(text)
        if m:
            return (next(g for g in m.groups() if g),)
    m = _SRUN_EXIT.search(text)
    if m:
        return (m["node"],)
    rank = _rank(text)
    if rank is not None and rank in layout:
        return (layout[rank],)
    return ()


def _classify(text: str, critical: frozenset) -> tuple[str, str, frozenset] | None:
    """(kind, class, tags) of one line, or None when it is evidence of nothing."""
    wrapped = _WRAPPED.search(text)
    if wrapped:
        inner = _root(wrapped[1], critical)
        if inner is not None:
            return inner
        own = _SOFTWARE.search(wrapped[1]) or _CUDA_FAILURE.search(wrapped[1])
        if _CASCADE.search(wrapped[1]) or own is None:
            tags = {"timeout"} if _TIMEOUT.search(wrapped[1]) else set()
            return "cascade", "hang", frozenset(tags)
    found = _root(text, critical)
    if found is not None:
        return found
    exited = _SRUN_EXIT.search(text)
    if exited:
        failed = exited["code"] not in (None, "0") or exited[0].endswith("Killed")
        tags = {"task-exit"} if failed else set()
        return "cascade", "hang", frozenset(tags)
    if _CUDA_FAILURE.search(text):
        return "root", "software", frozenset()
    if _CASCADE.search(text) or _NCCL_SYSTEM.search(text):
        return "cascade", "hang", frozenset({"timeout"} if _TIMEOUT.search(text) else ())
    if _SOFTWARE.search(text):
        return "root", "software", frozenset()
    return None


def _root(text: str, critical: frozenset) -> tuple[str, str, frozenset] | None:
    """The root-cause classes other than software (which is tested after the cascades)."""
    m = _XID.search(text)
    if m:
        xids = {int(m[1])} | {int(c) for c in _XID_CAUSE.findall(text)}
        if xids & critical:
            return "root", "hardware", frozenset({"xid"})
        if xids & APPLICATION_XIDS:
            return "root", "software", frozenset({"xid"})
        return None
    if _HARDWARE.search(text):
        return "root", "hardware", frozenset()
    if _OOM.search(text):
        return "root", "oom", frozenset()
    event = _IB_ASYNC.search(text)
    if event:
        return None if _IB_BENIGN.search(event[1]) else ("root", "network", frozenset())
    if _NETWORK.search(text) or (_NCCL_SYSTEM.search(text) and "NET/" in text):
        return "root", "network", frozenset()
    if _NUMERICS.search(text):
        return "root", "numerics", frozenset()
    cancelled = _CANCELLED.search(text)
    if cancelled:
        why = cancelled["why"] or ""
        tags = {"reasoned"} if why else set()
        if why == "NODE FAILURE":
            tags.add("node-failure")
        return "root", "preempted", frozenset(tags)
    if _NODE_FAILURE.search(text):
        return "root", "preempted", frozenset({"reasoned", "node-failure"})
    if _PREEMPTED.search(text):
        return "root", "preempted", frozenset()
    return None


def _keep(hits: list[_Hit], hit: _Hit) -> None:
    """Keep the first EVIDENCE_CAP hits of a file by line (a deferred hit may come in late)."""
    if len(hits) < EVIDENCE_CAP:
        bisect.insort(hits, hit, key=lambda h: h.line)
    elif hit.line < hits[-1].line:
        bisect.insort(hits, hit, key=lambda h: h.line)
        hits.pop()


@dataclass
class _File:
    """What is kept of one file while it is read."""

    index: int
    name: str
    roots: dict[str, list[_Hit]] = field(default_factory=dict)
    cascades: list[_Hit] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    last_ts: tuple | None = None
    first_ts: tuple | None = None
    iteration: int | None = None
    losses: deque = field(default_factory=lambda: deque(maxlen=SPIKE_WINDOW))
    overflows: list[_Hit] = field(default_factory=list)
    overflow_run: int = 0
    overflow_scale: float | None = None
    task_failed: bool = False  # a srun task exited non-zero or was killed
    nvrm: list | None = None  # [hit-or-None, line number, text, joined text, ts] of an NVRM message
    lines: int = 0
    frame: int | None = None  # column of `File "..."` on the line before (a traceback frame)


class _Scan:
    def __init__(self, layout: dict[int, str], critical: frozenset):
        self.layout = layout
        self.critical = critical
        self.files: list[_File] = []
        self.year: int | None = None  # of the first dated timestamp

    def read(self, index: int, name: str, lines) -> None:
        state = _File(index, name)
        self.files.append(state)
        block: list[str] = []
        for text in lines:
            block.append(text)
            if len(block) == _BLOCK:
                self._block(state, block)
                block = []
        self._block(state, block)

    def _block(self, f: _File, block: list[str]) -> None:
        """Lines in blocks: most blocks of a big log hold no word of _SCREEN at all, and one
        search of the block spares the per-line search."""
        screen = _screened("\n".join(block))
        first = f.lines + 1
        for offset, text in enumerate(block):
            self._line(f, first + offset, text, screen and _screened(text))
        f.lines += len(block)

    def _line(self, f: _File, number: int, text: str, screened: bool) -> None:
        stamp = _timestamp(text)
        if stamp is not None:
            f.last_ts = stamp
            if f.first_ts is None:
                f.first_ts = stamp
            if self.year is None and stamp[0] is not None:
                self.year = stamp[0]
        if f.nvrm is not None and text[:1].isspace() and _NVRM_CONTINUATION.match(text):
            self._continue_nvrm(f, text)
            return
        # A traceback echoes the source of each frame (`raise RuntimeError("CUDA error: ...")`):
        # code, not an error that happened; the exception line at the end is the evidence.
        # Source lines are indented two columns past their frame's `File`.
        column, frame = f.frame, _FRAME.search(text)
        f.frame = frame.start() if frame else None
        if (
            column is not None
            and frame is None
            and text[column : column + 2] == "  "
            and text[column:].strip()
        ):
            return
        progress = self._progress(f, text) if "iter" in text else None
        if progress is not None and progress[0] == "ok":
            f.nvrm = None
            return  # a training progress line: evidence only when NaN or a spike
        found = _classify(text, self.critical) if screened else None
        if progress is not None and (found is None or found[1] != "numerics"):
            found = ("root", "numerics", frozenset({progress[0]}))
        hit = None
        if found is not None:
            kind, cls, tags = found
            if cls == "preempted" and f.task_failed and "reasoned" not in tags and "*** STEP " in text:
                # srun --kill-on-bad-exit cancelling the step after a task failed: a consequence
                kind, cls, tags = "cascade", "hang", frozenset()
            hit = _Hit(f.index, f.name, number, text, kind, cls, f.last_ts, tags=tags)
            if kind == "root":
                hit.nodes = self._root_nodes(text, cls, tags)
                if cls == "numerics":
                    hit.anomaly = self._anomaly(f, text, progress)
                self._add_root(f, hit)
            else:
                exited = _SRUN_EXIT.search(text)
                if exited:
                    hit.nodes = (exited["node"],)
                    hit.exit_code = int(exited["code"]) if exited["code"] else None
                    if exited["n"] == "task":
                        hit.tags = hit.tags | {"single"}
                    if "task-exit" in hit.tags:
                        f.task_failed = True
                f.counts["hang"] = f.counts.get("hang", 0) + 1
                _keep(f.cascades, hit)
        elif "OVERFLOW!" in text and _OVERFLOW.search(text):
            self._overflow(f, number, text)
        f.nvrm = [hit, number, text, text, f.last_ts] if "NVRM:" in text else None

    def _root_nodes(self, text: str, cls: str, tags: frozenset) -> tuple[str, ...]:
        if cls == "preempted":
            if "node-failure" not in tags:
                return ()
            m = _CANCELLED.search(text) or _NODE_FAILURE.search(text)
            return (m[1],)
        return _nodes(text, self.layout)

    def _add_root(self, f: _File, hit: _Hit) -> None:
        f.counts[hit.cls] = f.counts.get(hit.cls, 0) + 1
        _keep(f.roots.setdefault(hit.cls, []), hit)

    def _continue_nvrm(self, f: _File, text: str) -> None:
        """A kernel message wrapped over several ``NVRM:`` lines ("The NVIDIA GPU 0000:b3:00.0 /
        ... has / fallen off the bus"): classified whole, reported at its first line."""
        head, number, first, joined, stamp = f.nvrm
        joined = f"{joined} {text.strip()}"
        f.nvrm[3] = joined
        if head is not None:
            return
        found = _root(joined, self.critical)
        if found is not None and found[0] == "root":
            hit = _Hit(f.index, f.name, number, first, "root", found[1], stamp, tags=found[2])
            hit.nodes = _nodes(first, self.layout)
            self._add_root(f, hit)
            f.nvrm[0] = hit

    def _progress(self, f: _File, text: str) -> tuple[str, int | None] | None:
        """Training progress on this line: ("ok" | "nan" | "spike", iteration), or None."""
        loss = grad = skipped = None
        m = _MEGATRON_ITER.search(text) if "|" in text else None
        if m:
            iteration = int(m[1])
            lm = _MEGATRON_LOSS.search(text)
            gn = _MEGATRON_GRAD.search(text)
            sk = _MEGATRON_SKIPPED.search(text)
            loss = _number(lm[1]) if lm else None
            grad = _number(gn[1]) if gn else None
            skipped = int(sk[1]) if sk else None
            nans = _MEGATRON_NANS.search(text)
            if nans and int(nans[1]) > 0:
                grad = float("nan")  # Megatron counted a NaN iteration since its last line
            lossy = lm is not None
        else:
            m = _LOCAL_ITER.search(text) if " consumed " in text else None
            if m:
                iteration, loss, grad, lossy = int(m[1]), _number(m[2]), _number(m[3]), True
            else:
                m = _NANOGPT_ITER.search(text)
                if not m:
                    return None
                iteration, loss, lossy = int(m[1]), _number(m[2]), True
        f.iteration = iteration
        bad = (lossy and loss is not None and not _finite(loss)) or (grad is not None and not _finite(grad))
        if bad:
            return "nan", iteration
        if not skipped:
            f.overflow_run, f.overflows = 0, []
        if _finite(loss):
            window = f.losses
            spike = len(window) == SPIKE_WINDOW and loss > SPIKE_FACTOR * _median(window)
            window.append(loss)
            if spike:
                return "spike", iteration
        return "ok", iteration

    def _anomaly(self, f: _File, text: str, progress) -> int | None:
        """The first iteration a numerical problem shows at: the one the line names, else the
        last iteration this file logged before it (a wrapped iteration record, a check that
        prints -1)."""
        if progress is not None and progress[0] in ("nan", "spike"):
            return progress[1]
        m = _EXPLICIT_ITER.search(text)
        if m and int(m[1]) >= 0:
            return int(m[1])
        return f.iteration

    def _overflow(self, f: _File, number: int, text: str) -> None:
        """DeepSpeed's fp16 ``OVERFLOW! ... Skipping step``: normal now and then, and normal in a
        row while DeepSpeed searches its initial loss scale down from 2^16..2^32. Five in a row
        (the scale halving each time, no good step between) that take the scale down to
        OVERFLOW_SCALE_FLOOR or below are a numerical problem."""
        m = _OVERFLOW.search(text)
        attempted, reduced = _number(m[1] or ""), _number(m[2] or "")
        if f.overflow_run and attempted is not None and attempted != f.overflow_scale:
            f.overflow_run, f.overflows = 0, []  # the scale grew back: good steps in between
        f.overflow_run += 1
        f.overflow_scale = (
            reduced if reduced is not None else attempted if attempted is not None else f.overflow_scale
        )
        hit = _Hit(f.index, f.name, number, text, "root", "numerics", f.last_ts, tags=frozenset({"overflow"}))
        hit.anomaly = f.iteration
        low = f.overflow_scale is None or f.overflow_scale <= OVERFLOW_SCALE_FLOOR
        if f.overflow_run < OVERFLOWS_FOR_NUMERICS or not low:
            f.overflows.append(hit)
            del f.overflows[:-OVERFLOWS_FOR_NUMERICS]
            return
        for pending in f.overflows:
            self._add_root(f, pending)
        f.overflows = []
        self._add_root(f, hit)

    # The decision.

    def _epoch(self, stamp: tuple | None) -> float | None:
        if stamp is None:
            return None
        if stamp[0] is not None or self.year is not None:
            return _epoch(stamp, stamp[0] or self.year)
        now = time.time()
        when = _epoch(stamp, time.gmtime(now).tm_year)
        return when if when <= now + 86400 else _epoch(stamp, time.gmtime(now).tm_year - 1)

    def result(self, exit_code: int | None) -> "Triage":
        roots, cascades = [], []
        for f in self.files:
            hits = sorted([h for group in f.roots.values() for h in group] + f.cascades, key=lambda h: h.line)
            latest = None
            for h in hits:
                h.at = self._epoch(h.ts)
                when = h.at if h.ts is not None else self._epoch(f.first_ts)
                if when is not None:
                    latest = when if latest is None else max(latest, when)
                # A file without any timestamp cannot be placed in time: first, in the order given.
                h.order = (
                    (0, 0.0, h.file_index, h.line) if latest is None else (1, latest, h.file_index, h.line)
                )
            roots += [h for h in hits if h.kind == "root"]
            cascades += [h for h in hits if h.kind == "cascade"]
        roots.sort(key=lambda h: h.order)
        cascades.sort(key=lambda h: h.order)
        return self._decide(roots, cascades, exit_code)

    def _decide(self, roots: list[_Hit], cascades: list[_Hit], exit_code: int | None) -> "Triage":
        exits = [h for h in cascades if h.exit_code in MEGATRON]
        if exit_code is None and exits:
            exit_code = exits[0].exit_code
        megatron = MEGATRON.get(exit_code)
        by_class: dict[str, list[_Hit]] = {}
        for h in roots:
            by_class.setdefault(h.cls, []).append(h)
        suspects: list[str] = []
        if "hardware" in by_class:
            cls, first = "hardware", by_class["hardware"][0]
        elif exit_code == 17:
            cls = "numerics"
            first = (by_class.get("numerics") or roots or [h for h in exits if h.exit_code == 17] or [None])[
                0
            ]
        elif roots:
            first = roots[0]
            cls = first.cls
            if cls == "preempted":
                reasoned = [h for h in by_class["preempted"] if "reasoned" in h.tags]
                first = reasoned[0] if reasoned else first
        elif cascades:
            cls, first = "hang", cascades[0]
            exited = next((h for h in cascades if "task-exit" in h.tags), None)
            timeout = next((h for h in cascades if "timeout" in h.tags), None)
            if (
                exited is not None
                and "single" in exited.tags
                and (timeout is None or exited.order < timeout.order)
            ):
                first = exited
                suspects.append(exited.nodes[0])
        else:
            cls, first = "unknown", None
        if cls not in ("hang", "unknown"):
            for h in by_class.get(cls, []):
                for node in h.nodes:
                    if node not in suspects:
                        suspects.append(node)
        if cls != "preempted":
            for h in exits:
                for node in h.nodes:
                    if node not in suspects:
                        suspects.append(node)
        chosen = by_class.get(cls, []) if cls != "hang" else cascades
        others = [h for h in roots if h.cls != cls] if cls != "hang" else []
        evidence = sorted(
            chosen[:EVIDENCE_CAP] + others[: max(0, EVIDENCE_CAP - len(chosen))], key=lambda h: h.order
        )
        anomaly = None
        if cls == "numerics":
            anomaly = next((h.anomaly for h in by_class.get("numerics", []) if h.anomaly is not None), None)
        iterations = [f.iteration for f in self.files if f.iteration is not None]
        return Triage(
            cls=cls,
            suspect_nodes=suspects,
            first_error=None if first is None else first.to_line(first.at),
            evidence=[h.to_line(h.at) for h in evidence],
            reason=self._reason(cls, first, by_class, cascades, exit_code),
            exit_code=exit_code,
            megatron=megatron,
            iteration=max(iterations) if iterations else None,
            anomaly_iteration=anomaly,
        )

    def _reason(self, cls, first, by_class, cascades, exit_code) -> str:
        where = f" (first at {first.file}:{first.line})" if first is not None else ""
        count = len(by_class.get(cls, [])) if cls != "hang" else len(cascades)
        lines = sum(f.lines for f in self.files)
        if cls == "unknown":
            return f"nothing recognised as a failure in {lines} lines of {len(self.files)} file(s)"
        if cls == "hardware":
            return (
                f"GPU hardware evidence (critical XID, uncorrectable ECC, GPU off the bus){where}; "
                "it outranks every other error, which a GPU fault commonly causes"
            )
        if cls == "numerics" and exit_code == 17 and not by_class.get("numerics"):
            return "Megatron exited 17: its result validation failed (a rerun gave a different result)"
        what = {
            "network": "an InfiniBand/NCCL network failure",
            "numerics": "a numerical failure (NaN/Inf, loss-scale collapse or a loss spike)",
            "oom": "out of memory",
            "software": "an exception or CUDA error with no hardware evidence anywhere",
            "preempted": "the scheduler or the cloud ended the job "
            "(time limit, preemption, cancellation, requeue)",
        }
        if cls == "hang":
            return (
                f"only consequences of a failure elsewhere ({count} lines: collective timeouts, closed "
                f"connections, exited tasks){where}: a rank stopped without logging why"
            )
        return f"the earliest root-cause line is {what[cls]}{where}; {count} such line(s)"


def triage(
    paths: list[Path],
    layout: dict[int, str] | None = None,
    exit_code: int | None = None,
    critical_xids: Iterable[int] | None = None,
) -> Triage:
    """Classify the failure the logs at ``paths`` show. ``layout`` maps a global rank to its node
    (for ``[rankN]:``, ``N: `` and ``[Rank N]`` prefixes); ``exit_code`` is the job's, if known;
    ``critical_xids`` defaults to CRITICAL_XIDS. Raises Unreadable for a file that cannot be read
    and UsageError for a directory."""
    critical = CRITICAL_XIDS if critical_xids is None else frozenset(int(x) for x in critical_xids)
    scan = _Scan(dict(layout or {}), critical)
    for index, path in enumerate(paths):
        path = Path(path)
        if path.is_dir():
            raise UsageError(f"{path}: is a directory; triage reads log files")
        try:
            scan.read(index, str(path), read_lines(path, LINE_BYTES))
        except OSError as e:
            raise unreadable(path, e) from e
    return scan.result(exit_code)
