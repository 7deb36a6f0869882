"""What a log line says: its timestamp, its rank and nodes, and the class of failure it is
evidence for (root) or a consequence of (cascade)."""

import calendar
import re

from tasks.job.save_log import SAVE_ERROR, SPACE
from tasks.recovery.triage.model import APPLICATION_XIDS, FailureClass

FRAME = re.compile(r'\bFile "[^"]+", line \d+')

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
    "space left", "quota", "read-only",
)  # fmt: skip


def screens(text: str) -> bool:
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
    r"|(?:Memory cgroup o|O)ut of memory: Kill(?:ed)? process|invoked oom-killer"
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
# Megatron-Core's rerun state machine (--rerun-mode validate_results) reruns an iteration whose
# result it rejects, and says what it was, in its log and in its result-rejected tracker file
# (``status=RerunValidationStatus.X``): not reproducible on the same GPU, a transient fault of that
# GPU; not reproducible on another GPU, the first GPU was wrong (so this line's node is the good
# one); reproducible on another GPU too, the result was right for its input: the data (or the code).
_RERUN_TRANSIENT = re.compile(
    r"First rerun: unexpected result is not reproducible|Possible transient error"
    r"|FIRST_RERUN_NOT_REPRODUCIBLE"
)
_RERUN_PERSISTENT = re.compile(
    r"Second rerun: unexpected result is not reproducible|Possible persistent error"
    r"|SECOND_RERUN_NOT_REPRODUCIBLE"
)
_RERUN_DATA = re.compile(
    r"Second rerun: unexpected result is reproducible|Correct result \(but possible Application error\)"
    r"|SECOND_RERUN_REPRODUCIBLE"
)
# Reproducible on the same GPU: undecided until another GPU reruns it; the GPU to avoid.
_RERUN_SUSPICIOUS = re.compile(r"status=\S*FIRST_RERUN_REPRODUCIBLE\b")
CANCELLED = re.compile(
    r"\*\*\* (?:JOB|STEP) \S+ ON (?P<host>\S+) CANCELLED AT \S+(?: DUE TO (?P<why>[A-Z][A-Z ]*?))? \*\*\*"
)
NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")
# The scheduler or the cloud took the nodes away (a preemption, a spot reclaim): no fault of the
# job's, so no count against its recovery budgets (tags "infrastructure").
_TAKEN_AWAY = re.compile(
    r"this job is preempted|\b(?:was|is|been|got) preempted\b|preemption notice|termination is imminent"
    r"|spot (?:instance )?(?:interruption|termination)"
)
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

# torchrun's agent on a worker that died of SIGSEGV (exit -11): that worker's own crash, as its
# summary's `Signal 11 (SIGSEGV)` is, not a consequence like -9 (killed) or -6 (aborted).
_SEGV_EXIT = re.compile(r"failed \(exitcode: -11\)")

# A CUDA failure reported through NCCL: this rank's own error, even inside a DistBackendError.
_CUDA_FAILURE = re.compile(r"Cuda failure (?:\d+ )?'|unhandled cuda error|ncclUnhandledCudaError")

# Consequences of another rank's failure.
_WRAPPED = re.compile(
    r"(?:watchdog thread terminated with exception|found async exception when checking for NCCL errors"
    r"|what\(\)):\s*(.*)"
)
SRUN_EXIT = re.compile(
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
    # A DataLoader worker killed from outside (the kernel's OOM killer, a job kill): the killer
    # is the evidence, not the worker.
    r"|DataLoader worker \(pid \d+\) is killed by signal: Killed"
)
_TIMEOUT = re.compile(r"timed? ?out|got stuck", re.I)

# torchrun's ChildFailedError summary: the first rank that failed, its host and how it ended.
#   Root Cause (first observed failure):
#   [0]:
#     host      : n12
#     rank      : 3 (local_rank: 3)
#     exitcode  : -9 (pid: 9246)  (SIGKILL)
#     traceback : Signal 9 (SIGKILL) received by PID 9246
TORCHRUN_ROOT = "Root Cause (first observed failure):"
TORCHRUN_BLOCK_LINES = 16  # a block not closed by then (its ==== line) is read as it stands
TORCHRUN_LABEL = re.compile(r"^(?:\d+: |\[rank\d+\]: ?)")  # srun --label's, torchrun's tee
TORCHRUN_FIELD = re.compile(r"^\s*(time|host|rank|local_rank|exitcode|error_file|traceback)\s*:\s*(.*?)\s*$")

# Where a line names its node or rank.
_MEGATRON_NODE = re.compile(r"\bRank -?\d+, node ([^\s,]+), device\b|\bnode=(\S+) device=\S+ jobID=")
# The GPU the rerun state machine names (its log line, its tracker file): node and device.
MEGATRON_GPU = re.compile(r"\bRank -?\d+, node ([^\s,]+), device (\d+)|\bnode=(\S+) device=(\d+) jobID=")


def gpus_of(text: str) -> list[str]:
    """``node:device`` for each GPU a rerun state machine's line names."""
    return [f"{m[1] or m[3]}:{m[2] or m[4]}" for m in MEGATRON_GPU.finditer(text)]


# NCCL's `host:pid:tid [local rank]`, also behind Open MPI's --tag-output `[1,0]<stdout>:`.
NCCL_HOST = re.compile(r"(?:^|(?<=[\s\]>])|(?<=>:))([A-Za-z0-9][\w.-]*):\d+:\d+ \[\d+\]")
_KERNEL_HOST = re.compile(
    rf"^(?:(?:{_MON}) +\d\d? \d\d:\d\d:\d\d(?:\.\d+)?Z?"
    r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?)\s+(\S+)\s+(?:kernel|[\w.-]+\[\d+\]):"
    r"|^(\S+): kern:"
)
_MILABENCH = re.compile(r"^[^\s.]+\.(\S+) \[std(?:err|out)\]")
_RANK = (re.compile(r"\[rank(\d+)\]:"), re.compile(r"^(\d+): "), re.compile(r"\bRank (\d+)\b"))

# Progress lines.
MEGATRON_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
MEGATRON_LOSS = re.compile(r"\blm loss:\s*([-+\w.]+)")
MEGATRON_GRAD = re.compile(r"\bgrad norm:\s*([-+\w.]+)")
MEGATRON_SKIPPED = re.compile(r"number of skipped iterations:\s*(\d+)")
MEGATRON_NANS = re.compile(r"number of nan iterations:\s*(\d+)")
LOCAL_ITER = re.compile(r"\biteration (\d+) consumed \d+ lr \S+ loss (\S+) grad_norm (\S+)")
NANOGPT_ITER = re.compile(r"\biter (\d+): loss ([-+\w.]+)")
EXPLICIT_ITER = re.compile(r"\biteration (-?\d+): Unexpected result")
# The tracker's line of a rerun from a checkpoint: there its iteration is the one the log prints.
TRACKER_SECOND_RERUN = re.compile(r"\biteration=(\d+) status=\S*SECOND_RERUN_")
LOADED_ITER = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")
RERUN_ITER = re.compile(
    r"Unexpected result \S+ on rank \d+ at iteration #\d+|(?:First|Second) rerun: unexpected result"
    r"|iteration #\d+: (?:Correct result|Possible (?:transient|persistent) error)"
)
# DeepSpeed's `OVERFLOW! ... Skipping step. Attempted loss scale: A, reducing to R`, fairseq's
# `overflow detected, setting loss scale to: R`.
OVERFLOW = re.compile(
    r"OVERFLOW!.*Skipping step(?:.*Attempted loss scale:\s*(\S+?),\s*reducing to\s*(\S+))?"
    r"|overflow detected, setting loss scale to:\s*(\S+)"
)
NVRM_CONTINUATION = re.compile(r"^\s+NVRM: ")


def as_number(text: str) -> float | None:
    try:
        return float(text.rstrip(",|"))
    except ValueError:
        return None


def median_of(values) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def is_finite(value: float | None) -> bool:
    return value is not None and value == value and abs(value) != float("inf")


def timestamp_of(text: str) -> tuple | None:
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


def epoch_of(stamp: tuple, year: int) -> float:
    y, month, day, hour, minute, second = stamp
    whole = int(second)
    return calendar.timegm((y or year, month, day, hour, minute, whole, 0, 0, 0)) + (second - whole)


def rank_of(text: str) -> int | None:
    for pattern in _RANK:
        m = pattern.search(text)
        if m:
            return int(m[1])
    return None


def nodes_of(text: str, layout: dict[int, str]) -> tuple[str, ...]:
    """The node a root line names: Megatron's ``node N``, NCCL's ``host:pid:tid [gpu]``, a kernel
    log's host, a launcher's ``bench.node [stderr]``, else its rank through the layout."""
    for pattern in (_MEGATRON_NODE, NCCL_HOST, _KERNEL_HOST, _MILABENCH):
        m = pattern.search(text)
        if m:
            return (next(g for g in m.groups() if g),)
    m = SRUN_EXIT.search(text)
    if m:
        return (m["node"],)
    rank = rank_of(text)
    if rank is not None and rank in layout:
        return (layout[rank],)
    return ()


def classify_line(text: str, critical: frozenset) -> tuple[str, str, frozenset] | None:
    """(kind, class, tags) of one line, or None when it is evidence of nothing."""
    wrapped = _WRAPPED.search(text)
    if wrapped:
        inner = root_of(wrapped[1], critical)
        if inner is not None:
            return inner
        own = _SOFTWARE.search(wrapped[1]) or _CUDA_FAILURE.search(wrapped[1])
        if _CASCADE.search(wrapped[1]) or own is None:
            tags = {"timeout"} if _TIMEOUT.search(wrapped[1]) else set()
            return "cascade", FailureClass.HANG, frozenset(tags)
    found = root_of(text, critical)
    if found is not None:
        return found
    exited = SRUN_EXIT.search(text)
    if exited:
        failed = exited["code"] not in (None, "0") or exited[0].endswith("Killed")
        tags = {"task-exit"} if failed else set()
        return "cascade", FailureClass.HANG, frozenset(tags)
    if _CUDA_FAILURE.search(text) or _SEGV_EXIT.search(text):
        return "root", FailureClass.SOFTWARE, frozenset()
    if _CASCADE.search(text) or _NCCL_SYSTEM.search(text):
        return "cascade", FailureClass.HANG, frozenset({"timeout"} if _TIMEOUT.search(text) else ())
    if _SOFTWARE.search(text):
        return "root", FailureClass.SOFTWARE, frozenset()
    return None


def root_of(text: str, critical: frozenset) -> tuple[str, str, frozenset] | None:
    """The root-cause classes other than software (which is tested after the cascades)."""
    m = _XID.search(text)
    if m:
        xids = {int(m[1])} | {int(c) for c in _XID_CAUSE.findall(text)}
        if xids & critical:
            return "root", FailureClass.HARDWARE, frozenset({"xid"})
        if xids & APPLICATION_XIDS:
            return "root", FailureClass.SOFTWARE, frozenset({"xid"})
        return None
    if _HARDWARE.search(text):
        return "root", FailureClass.HARDWARE, frozenset()
    if SAVE_ERROR.search(text):
        return "root", FailureClass.SAVE_FAILED, frozenset({"space"} if SPACE.search(text) else ())
    if _OOM.search(text):
        return "root", FailureClass.OOM, frozenset()
    event = _IB_ASYNC.search(text)
    if event:
        return None if _IB_BENIGN.search(event[1]) else ("root", FailureClass.NETWORK, frozenset())
    if _NETWORK.search(text) or (_NCCL_SYSTEM.search(text) and "NET/" in text):
        return "root", FailureClass.NETWORK, frozenset()
    if _RERUN_TRANSIENT.search(text):
        return "root", FailureClass.HARDWARE, frozenset({"rerun"})
    if _RERUN_PERSISTENT.search(text):
        return "root", FailureClass.HARDWARE, frozenset({"rerun", "elsewhere"})
    if _RERUN_DATA.search(text):
        return "root", FailureClass.DATA, frozenset({"rerun"})
    if _RERUN_SUSPICIOUS.search(text):
        return "root", FailureClass.NUMERICS, frozenset({"rerun", "suspicious"})
    if _NUMERICS.search(text):
        return "root", FailureClass.NUMERICS, frozenset()
    cancelled = CANCELLED.search(text)
    if cancelled:
        why = cancelled["why"] or ""
        tags = {"reasoned"} if why else set()
        if why == "NODE FAILURE":
            tags.add("node-failure")
        if why == "PREEMPTION":
            tags.add("infrastructure")
        return "root", FailureClass.PREEMPTED, frozenset(tags)
    if NODE_FAILURE.search(text):
        return "root", FailureClass.PREEMPTED, frozenset({"reasoned", "node-failure"})
    if _PREEMPTED.search(text):
        tags = {"infrastructure"} if _TAKEN_AWAY.search(text) else set()
        return "root", FailureClass.PREEMPTED, frozenset(tags)
    return None
