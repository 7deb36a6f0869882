"""Reading the logs: each file a block of lines at a time, keeping only the evidence (the first
root and cascade lines of each file, the progress lines that show a numerical anomaly)."""

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from tasks.job.save_log import WriterTrace, save_directory, writers
from tasks.recovery.triage.decide import Decide
from tasks.recovery.triage.model import (
    BLOCK,
    MEGATRON,
    OVERFLOW_SCALE_FLOOR,
    OVERFLOWS_FOR_NUMERICS,
    SPIKE_FACTOR,
    SPIKE_WINDOW,
    FailureClass,
    Hit,
    keep_first,
)
from tasks.recovery.triage.patterns import (
    CANCELLED,
    EXPLICIT_ITER,
    FRAME,
    LOADED_ITER,
    LOCAL_ITER,
    MEGATRON_GRAD,
    MEGATRON_ITER,
    MEGATRON_LOSS,
    MEGATRON_NANS,
    MEGATRON_SKIPPED,
    NANOGPT_ITER,
    NCCL_HOST,
    NODE_FAILURE,
    NVRM_CONTINUATION,
    OVERFLOW,
    RERUN_ITER,
    SRUN_EXIT,
    TORCHRUN_BLOCK_LINES,
    TORCHRUN_FIELD,
    TORCHRUN_LABEL,
    TORCHRUN_ROOT,
    TRACKER_SECOND_RERUN,
    as_number,
    classify_line,
    epoch_of,
    is_finite,
    median_of,
    nodes_of,
    root_of,
    screens,
    timestamp_of,
)


@dataclass
class _File:
    """What is kept of one file while it is read."""

    index: int
    name: str
    roots: dict[str, list[Hit]] = field(default_factory=dict)
    cascades: list[Hit] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    last_ts: tuple | None = None
    first_ts: tuple | None = None
    iteration: int | None = None
    losses: deque = field(default_factory=lambda: deque(maxlen=SPIKE_WINDOW))
    overflows: list[Hit] = field(default_factory=list)
    overflow_run: int = 0
    overflow_scale: float | None = None
    task_failed: bool = False  # a srun task exited non-zero or was killed
    nvrm: list | None = None  # [hit-or-None, line number, text, joined text, ts] of an NVRM message
    lines: int = 0
    frame: int | None = None  # column of `File "..."` on the line before (a traceback frame)
    summaries: dict = field(default_factory=dict)  # torchrun's root-cause blocks open, by label
    hosts: set = field(default_factory=set)  # hosts NCCL's `host:pid:tid [local rank]` lines name (2 at most)
    trace: WriterTrace = field(default_factory=WriterTrace)  # a traceback through a checkpoint writer


class Scan(Decide):
    def __init__(self, layout: dict[int, str], critical: frozenset):
        self.layout = layout
        self.critical = critical
        self.files: list[_File] = []
        self.year: int | None = None  # of the first dated timestamp
        self.save_dirs: set[str] = set()  # the directories the logs' saves write to (16 at most)

    def read(self, index: int, name: str, lines) -> None:
        state = _File(index, name)
        self.files.append(state)
        block: list[str] = []
        for text in lines:
            block.append(text)
            if len(block) == BLOCK:
                self._block(state, block)
                block = []
        self._block(state, block)
        for summary in state.summaries.values():  # a log cut short inside torchrun's summary
            self._torchrun_exit(state, summary)
        state.summaries.clear()
        self._file_host(state)

    def _file_host(self, f: _File) -> None:
        """A per-rank log names its host in NCCL's ``host:pid:tid [local rank]`` lines: a root line
        of that file without a node of its own (``[rank5]: ... uncorrectable ECC error``, no layout)
        happened on that host, if the file's NCCL lines name exactly one. A file that names two or
        more (several nodes' output in one file) says nothing of where such a line came from. A
        preempted job still has no suspects."""
        if len(f.hosts) != 1:
            return
        (host,) = f.hosts
        for hits in f.roots.values():
            for hit in hits:
                if not hit.nodes and hit.cls != FailureClass.PREEMPTED:
                    hit.nodes = (host,)

    def _block(self, f: _File, block: list[str]) -> None:
        """Lines in blocks: most blocks of a big log hold no word of _SCREEN at all, and one
        search of the block spares the per-line search."""
        screen = screens("\n".join(block))
        first = f.lines + 1
        for offset, text in enumerate(block):
            self._line(f, first + offset, text, screen and screens(text))
        f.lines += len(block)

    def _line(self, f: _File, number: int, text: str, screened: bool) -> None:
        in_writer = f.trace.feed(text)
        if len(self.save_dirs) < 16 and (directory := save_directory(text)):
            self.save_dirs.add(directory)
        stamp = timestamp_of(text)
        if stamp is not None:
            f.last_ts = stamp
            if f.first_ts is None:
                f.first_ts = stamp
            if self.year is None and stamp[0] is not None:
                self.year = stamp[0]
        if "NCCL" in text and len(f.hosts) < 2:
            host = NCCL_HOST.search(text)
            if host is not None:
                f.hosts.add(host[1])
        if f.nvrm is not None and text[:1].isspace() and NVRM_CONTINUATION.match(text):
            self._continue_nvrm(f, text)
            return
        if f.summaries or TORCHRUN_ROOT in text:
            self._torchrun_summary(f, number, text)
        if "successfully loaded checkpoint" in text:
            loaded = LOADED_ITER.search(text)
            if loaded:  # a run stands at the checkpoint it loaded until it logs an iteration
                f.iteration = int(loaded[1])
        # A traceback echoes the source of each frame (`raise RuntimeError("CUDA error: ...")`):
        # code, not an error that happened; the exception line at the end is the evidence.
        # Source lines are indented two columns past their frame's `File`.
        column, frame = f.frame, FRAME.search(text)
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
        found = classify_line(text, self.critical) if screened else None
        if (
            found is not None
            and found[1] == FailureClass.SAVE_FAILED
            and not writers(text, self.save_dirs, in_writer)
        ):
            found = None  # the OS's words, not the saving ranks' writer's (a wandb cache, a loader)
        if progress is not None and (found is None or found[1] != FailureClass.NUMERICS):
            found = ("root", FailureClass.NUMERICS, frozenset({progress[0]}))
        hit = None
        if found is not None:
            kind, cls, tags = found
            if (
                cls == FailureClass.PREEMPTED
                and f.task_failed
                and "reasoned" not in tags
                and "*** STEP " in text
            ):
                # srun --kill-on-bad-exit cancelling the step after a task failed: a consequence
                kind, cls, tags = "cascade", FailureClass.HANG, frozenset()
            hit = Hit(f.index, f.name, number, text, kind, cls, f.last_ts, tags=tags)
            if kind == "root":
                hit.nodes = self._root_nodes(text, cls, tags)
                if cls in (FailureClass.NUMERICS, FailureClass.DATA):
                    hit.anomaly = self._anomaly(f, text, progress)
                self._add_root(f, hit)
            else:
                exited = SRUN_EXIT.search(text)
                if exited:
                    hit.nodes = (exited["node"],)
                    hit.exit_code = int(exited["code"]) if exited["code"] else None
                    if exited["n"] == "task":
                        hit.tags = hit.tags | {"single"}
                    if "task-exit" in hit.tags:
                        f.task_failed = True
                f.counts[FailureClass.HANG] = f.counts.get(FailureClass.HANG, 0) + 1
                keep_first(f.cascades, hit)
        elif ("OVERFLOW!" in text or "overflow detected" in text) and OVERFLOW.search(text):
            self._overflow(f, number, text)
        f.nvrm = [hit, number, text, text, f.last_ts] if "NVRM:" in text else None

    def _torchrun_summary(self, f: _File, number: int, text: str) -> None:
        """torchrun's root-cause block, read field by field (one open block per srun label, as
        several nodes' agents may print at once): the rank that failed first, as one task exit
        (srun's ``task N: Exited``). Its host is the suspect of a hang when it ended before any
        timeout, and Megatron's 16 or 17 count as its exit code (every rank exits with those, so
        the first to do so is no suspect)."""
        label = TORCHRUN_LABEL.match(text)
        prefix = label[0] if label else ""
        body = text[len(prefix) :]
        if TORCHRUN_ROOT in body:
            if prefix in f.summaries:
                self._torchrun_exit(f, f.summaries.pop(prefix))
            f.summaries[prefix] = {"line": number, "lines": 0}
            return
        summary = f.summaries.get(prefix)
        if summary is None:
            return
        summary["lines"] += 1
        field_ = TORCHRUN_FIELD.match(body)
        if field_ is not None:
            summary[field_[1]] = field_[2]
        if body.startswith("====") or "traceback" in summary or summary["lines"] > TORCHRUN_BLOCK_LINES:
            self._torchrun_exit(f, f.summaries.pop(prefix))

    def _torchrun_exit(self, f: _File, summary: dict) -> None:
        """The block as a cascade hit, if it named a host and an exit code. Its text is the
        block's first line with those fields. Kept past the cap on cascades: the summary is the
        last thing a log holds."""
        if "host" not in summary or "exitcode" not in summary:
            return
        code = summary["exitcode"].split()[0]
        # torchrun prints the FQDN (workergpu008.cm.cluster); Slurm knows the node by its name.
        host = summary["host"]
        node = host if host.replace(".", "").isdigit() else host.split(".", 1)[0]
        exit_code = int(code) if code.lstrip("-").isdigit() and int(code) >= 0 else None
        # Every rank exits Megatron's 16 or 17 together: the first to do so is no suspect, and the
        # exit is the job's code, not one task's failure.
        together = exit_code in MEGATRON
        hit = Hit(
            f.index,
            f.name,
            summary["line"],
            f"{TORCHRUN_ROOT} rank {summary.get('rank', '?')} on {host}, exitcode {summary['exitcode']}",
            "cascade",
            FailureClass.HANG,
            f.last_ts,
            nodes=() if together else (node,),
            tags=frozenset({"torchrun"} if together else {"task-exit", "single", "torchrun"}),
            exit_code=exit_code,
        )
        f.task_failed = True
        f.counts[FailureClass.HANG] = f.counts.get(FailureClass.HANG, 0) + 1
        bisect.insort(f.cascades, hit, key=lambda h: h.line)

    def _root_nodes(self, text: str, cls: str, tags: frozenset) -> tuple[str, ...]:
        if cls == FailureClass.PREEMPTED:
            if "node-failure" not in tags:
                return ()
            m = CANCELLED.search(text) or NODE_FAILURE.search(text)
            return (m[1],)
        return nodes_of(text, self.layout)

    def _add_root(self, f: _File, hit: Hit) -> None:
        f.counts[hit.cls] = f.counts.get(hit.cls, 0) + 1
        keep_first(f.roots.setdefault(hit.cls, []), hit)

    def _continue_nvrm(self, f: _File, text: str) -> None:
        """A kernel message wrapped over several ``NVRM:`` lines ("The NVIDIA GPU 0000:b3:00.0 /
        ... has / fallen off the bus"): classified whole, reported at its first line."""
        head, number, first, joined, stamp = f.nvrm
        joined = f"{joined} {text.strip()}"
        f.nvrm[3] = joined
        if head is not None:
            return
        found = root_of(joined, self.critical)
        if found is not None and found[0] == "root":
            hit = Hit(f.index, f.name, number, first, "root", found[1], stamp, tags=found[2])
            hit.nodes = nodes_of(first, self.layout)
            self._add_root(f, hit)
            f.nvrm[0] = hit

    def _progress(self, f: _File, text: str) -> tuple[str, int | None] | None:
        """Training progress on this line: ("ok" | "nan" | "spike", iteration), or None."""
        loss = grad = skipped = None
        m = MEGATRON_ITER.search(text) if "|" in text else None
        if m:
            iteration = int(m[1])
            lm = MEGATRON_LOSS.search(text)
            gn = MEGATRON_GRAD.search(text)
            sk = MEGATRON_SKIPPED.search(text)
            loss = as_number(lm[1]) if lm else None
            grad = as_number(gn[1]) if gn else None
            skipped = int(sk[1]) if sk else None
            nans = MEGATRON_NANS.search(text)
            if nans and int(nans[1]) > 0:
                grad = float("nan")  # Megatron counted a NaN iteration since its last line
            lossy = lm is not None
        else:
            m = LOCAL_ITER.search(text) if " consumed " in text else None
            if m:
                iteration, loss, grad, lossy = int(m[1]), as_number(m[2]), as_number(m[3]), True
            else:
                m = NANOGPT_ITER.search(text)
                if not m:
                    return None
                iteration, loss, lossy = int(m[1]), as_number(m[2]), True
        f.iteration = iteration
        bad = (lossy and loss is not None and not is_finite(loss)) or (
            grad is not None and not is_finite(grad)
        )
        if bad:
            return "nan", iteration
        if not skipped:
            f.overflow_run, f.overflows = 0, []
        if is_finite(loss):
            window = f.losses
            spike = len(window) == SPIKE_WINDOW and loss > SPIKE_FACTOR * median_of(window)
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
        m = EXPLICIT_ITER.search(text) or TRACKER_SECOND_RERUN.search(text)
        if m and int(m[1]) >= 0:
            return int(m[1])
        if RERUN_ITER.search(text) and f.iteration is not None:
            # Megatron-Core 0.19's rerun state machine ("Unexpected result nan on rank 1 at
            # iteration #4") counts its own invocations, not the iterations the log prints: the
            # anomaly is in the iteration after the last one logged.
            return f.iteration + 1
        return f.iteration

    def _overflow(self, f: _File, number: int, text: str) -> None:
        """DeepSpeed's fp16 ``OVERFLOW! ... Skipping step`` (fairseq's ``overflow detected,
        setting loss scale to``): normal now and then, and normal in a row while DeepSpeed
        searches its initial loss scale down from 2^16..2^32. Five in a row (the scale halving
        each time, no good step between) that take the scale down to OVERFLOW_SCALE_FLOOR or
        below are a numerical problem."""
        m = OVERFLOW.search(text)
        attempted, reduced = as_number(m[1] or ""), as_number(m[2] or m[3] or "")
        previous = f.overflow_scale
        grew = (attempted is not None and attempted != previous) or (
            attempted is None and reduced is not None and previous is not None and reduced >= previous
        )
        if f.overflow_run and grew:
            f.overflow_run, f.overflows = 0, []  # the scale grew back: good steps in between
        f.overflow_run += 1
        f.overflow_scale = (
            reduced if reduced is not None else attempted if attempted is not None else f.overflow_scale
        )
        hit = Hit(
            f.index,
            f.name,
            number,
            text,
            "root",
            FailureClass.NUMERICS,
            f.last_ts,
            tags=frozenset({"overflow"}),
        )
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
            return epoch_of(stamp, stamp[0] or self.year)
        now = time.time()
        when = epoch_of(stamp, time.gmtime(now).tm_year)
        return when if when <= now + 86400 else epoch_of(stamp, time.gmtime(now).tm_year - 1)
