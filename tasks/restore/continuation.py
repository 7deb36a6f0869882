"""The continuation drill: train the job from the restored copy for K iterations and compare its
log with the original run's for those iterations.

The job starts from its own batch script (``drill.continuation.script``, default
``recovery.script``) as a relaunch starts it (``tasks.relaunch.launch``), with ``CKPT_LOAD`` (the
restored copy's save directory), ``CKPT_SAVE`` (a folder in the drill's scratch), ``CKPT_STEP=N``,
``CKPT_EXIT_INTERVAL=N+K`` and ``CKPT_LOG`` in its environment and ``--ckpt-step N`` after it: a
Megatron-LM script passes ``--load "$CKPT_LOAD" --save "$CKPT_SAVE" --ckpt-step "$CKPT_STEP"
--exit-interval "$CKPT_EXIT_INTERVAL"`` and writes its output to ``$CKPT_LOG``. The reference is
the original run's own log (``drill.continuation.reference``, default ``recovery.step_records``):
nothing is compared that it has not logged yet. The comparison is the one any run started from
a checkpoint gets (``tasks.relaunch.continuity``): resume point, learning rate, loss and grad norm
where both runs printed them over the same iterations, skipped and NaN steps.

What the script says is only a pre-check (``tasks.relaunch.fit``). The authority is the
arguments block Megatron-LM prints at start (``tasks.relaunch.printed``), read from the run's
own log as soon as it is there: a run that does not fit the checkpoint, loads anything but the
copy, saves anywhere but ``CKPT_SAVE`` or makes any other save (non-persistent, converted)
outside it is stopped (every process it started, or ``scancel``) before its first iteration,
naming the argument. Whatever the script does, the job's save directory is fingerprinted before
and after (each checkpoint file's size, mtime, ctime and inode, the set of iterations, the whole
bytes of Megatron-LM's and Megatron-Bridge's trackers and of ckptops' pointer), and the promoted
checkpoint and the one drilled are read again whole against their manifests after the run,
whatever its outcome: any change, a new iteration included, fails the drill (``PRODUCTION``) and
names what changed. A run is evidence only if its log shows Megatron-LM loading that very
iteration from the copy and its iterations are stamped after the drill began.
"""

import contextlib
import math
import os
import re
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tasks.checkpoint import dialect, layout
from tasks.checkpoint.facts import checkpoint_facts
from tasks.checkpoint.manifest import Manifest, read_manifest, valid_for_this_save
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.signing import Trust
from tasks.checkpoint.state import State, VerifyOptions
from tasks.checkpoint.verify import verify_checkpoint
from tasks.cluster import process
from tasks.errors import CkptopsError, UsageError
from tasks.job import step_records
from tasks.job.step_records import Steps, load_steps
from tasks.outcome import Check, Outcome
from tasks.relaunch.continuity import Continuity
from tasks.relaunch.fit import Compatibility, Kind, checkpoint_fit
from tasks.relaunch.launch import Launch, job_directory, watch_printed
from tasks.relaunch.printed import PrintedArgs, fit_printed
from tasks.relaunch.script import mentions
from tasks.restore.history import drilled_layouts
from tasks.restore.launch import allocation_options, cancel, sbatch_wait
from tasks.storage.bounded import read_bounded
from tasks.storage.local import open_regular

# Relative tolerance of the loss and grad norm at the first iteration and after it, by the
# profile's word (bf16 as NeMo Automodel's resume tests hold it).
TOLERANCES = {"exact": (0.0, 0.0), "fp32": (1e-6, 1e-6), "bf16": (1e-6, 5e-3)}
ARGUMENTS = "relaunch arguments"  # the job's script against the checkpoint (tasks.relaunch.fit)
PRINTED = "printed arguments"  # what Megatron-LM printed it runs with, against the checkpoint
PRODUCTION = "save directory"  # the job's own save directory, untouched by the continuation
EVIDENCE = "continuation evidence"  # the run loaded this copy and trained now
# Megatron-LM's "  successfully loaded checkpoint from DIR [ t 1/1, ... ] at iteration N".
_LOADED = re.compile(r"successfully loaded checkpoint from (.*) \[ t \d+/\d+.*\] at iteration (\d+)\s*$")
# What a tracker holds when it names an iteration (as ``tasks.checkpoint.pointer`` reads it).
_TRACKER_TEXT = re.compile(rb"\s*([0-9]+)\s*")
# Arguments that name where Megatron-LM writes a checkpoint (megatron-core 0.19.2's
# CheckpointConfig): ``save`` is CKPT_SAVE or none, the others none or inside CKPT_SAVE (the
# non-persistent saves, local or global; ``--ckpt-convert-save``, where training.py saves the
# loaded checkpoint converted, tracker and all, before any iteration).
_SAVES = ("save", "non_persistent_global_ckpt_dir", "non_persistent_local_ckpt_dir", "ckpt_convert_save")


@dataclass
class Continued:
    """A continuation's outcome, what it says, the comparison's checks, and the largest relative
    difference of the losses and grad norms it compared. ``touched``: what changed in the job's
    save directory while it ran (the caller raises the alarm)."""

    outcome: Outcome
    detail: str
    checks: list[Check] = field(default_factory=list)
    largest_difference: float | None = None
    series: dict | None = None  # per iteration, both runs' loss and learning rate (``series``)
    touched: str | None = None


def continuation_sources(profile) -> tuple[Path, Steps]:
    """The job's batch script and the original run's log (read once, here), checked before
    anything is restored."""
    settings, recovery = profile.drill.continuation, profile.recovery
    script = settings.script or (recovery.script if recovery else None)
    reference = settings.reference or step_records.configured(profile)
    if script is None:
        raise UsageError(
            f"{profile.source}: drill.continuation.script (or recovery.script): the job's batch script"
        )
    if reference is None:
        raise UsageError(
            f"{profile.source}: drill.continuation.reference (or recovery.step_records): "
            "the original run's log"
        )
    script = Path(script)
    try:
        with open_regular(script) as f:  # a FIFO would hang the drill; refused in one line
            text = f.read().decode(errors="replace")
    except (UsageError, CkptopsError) as e:
        raise UsageError(f"the job's batch script: {e}") from None
    except OSError as e:
        raise UsageError(f"{script}: the job's batch script cannot be read ({e.strerror})") from None
    if not mentions(text, "CKPT_LOAD"):  # a comment that names it reads nothing
        raise UsageError(
            f"{script}: does not read CKPT_LOAD: it would train from, and save into, the job's own "
            "checkpoints (docs/archive-and-drills.md#the-continuation-drill: the lines a script needs)"
        )
    try:
        return script, load_steps(reference)
    except FileNotFoundError:
        raise UsageError(f"{reference}: the original run's log is not there") from None


def checkable_up_to(before: Steps, steps: int) -> int | None:
    """The newest checkpoint iteration whose next ``steps`` iterations the original run
    (``before``, its log) has logged: its last iteration less ``steps``; None when it has none."""
    return int(before.iteration.max()) - steps if len(before) else None


# ---------------------------------------------------------------- the save directory, untouched

# What a resume reads beside its iterations: Megatron-LM's tracker, Megatron-Bridge's (the
# ``latest_train_state.pt`` its resume reads) and ckptops' pointer, each kept whole.
TRACKERS = (layout.MEGATRON_TRACKER, dialect.LATEST_TRAIN_STATE, layout.POINTER)
_TRACKER_BYTES = 1 << 20  # the most kept of a tracker: Megatron's holds a number, Bridge's a few KB
_STAT = ("kind", "size", "mtime", "ctime", "inode", "mode")


def fingerprint(save_dir: Path, leave_out: set[Path]) -> dict[str, tuple]:
    """What a resume from ``save_dir`` reads, as no script can put back: every entry of its
    ``iter_*`` checkpoints and of Megatron-Bridge's ``energon/`` data loader states by its path
    (kind, size, mtime_ns, ctime_ns, inode, mode; links not followed: a file rewritten and its
    mtime stamped back still has a new ctime), and each tracker (``TRACKERS``) with its whole
    bytes.
    ckptops's own records (``.ckptops*``: its other runs write them meanwhile, each through its
    own guards), the job's logs and TensorBoard files are no resume point and are left out, as is
    ``leave_out`` (the continuation's kept log). Walked with ``os.scandir`` on strings: a
    seed-sized save directory has three checkpoints of 5,120 files."""
    found: dict[str, tuple] = {}
    root = os.fspath(save_dir)
    skipped = {os.fspath(p) for p in leave_out}
    pending = []
    with contextlib.suppress(OSError), os.scandir(root) as top:
        for entry in top:
            if layout.parse_iter_dir(entry.name) is not None or entry.name == dialect.DATALOADER_SUBDIR:
                described = _entry(entry)
                if described is not None:
                    found[entry.name] = described
                    if described[0] == "dir":
                        pending.append(entry.name)
    while pending:
        relative = pending.pop()
        try:
            with os.scandir(os.path.join(root, relative)) as listed:
                entries = list(listed)
        except OSError as e:
            found[relative] = ("unreadable", e.strerror)
            continue
        for entry in entries:
            if entry.path in skipped:
                continue
            described = _entry(entry)
            if described is None:
                continue  # removed while listed: the next fingerprint says it
            name = f"{relative}/{entry.name}"
            found[name] = described
            if described[0] == "dir":
                pending.append(name)
    for name in TRACKERS:
        found[name] = _tracker(Path(save_dir) / name)
    return found


def _entry(entry: os.DirEntry) -> tuple | None:
    try:
        return _described(entry.stat(follow_symlinks=False))
    except OSError:
        return None


def _described(st: os.stat_result) -> tuple:
    kind = "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "file"
    mode = stat.S_IMODE(st.st_mode)
    if kind == "dir":  # its size and times move with entries made in it, each fingerprinted
        return (kind, None, None, None, st.st_ino, mode)
    return (kind, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, mode)


def _tracker(path: Path) -> tuple | None:
    """A tracker as ``_described`` says it, and its bytes (the refusal, for a link, a FIFO or one
    past ``_TRACKER_BYTES``); None when there is none."""
    try:
        described = _described(path.lstat())
    except FileNotFoundError:
        return None
    except OSError as e:
        return ("unreadable", e.strerror)
    try:
        content: bytes | str = read_bounded(path, _TRACKER_BYTES, "a tracker", follow=False)
    except (CkptopsError, OSError) as e:
        content = str(e)
    return (*described, content)


def _iteration(name: str) -> int | None:
    """The iteration an entry belongs to: ``iter_N/...`` or ``energon/iter_N/...``."""
    parts = name.split("/", 2)
    if parts[0] == dialect.DATALOADER_SUBDIR:
        return layout.parse_iter_dir(parts[1]) if len(parts) > 1 else None
    return layout.parse_iter_dir(parts[0])


def _new_iteration(name: str, had: set[int]) -> str | None:
    """The folder of an iteration that was not there before ``name`` is in (None if there was)."""
    iteration = _iteration(name)
    if iteration is None or iteration in had:
        return None
    head = name.split("/", 2)
    return "/".join(head[:2]) if head[0] == dialect.DATALOADER_SUBDIR else head[0]


def changes(before: dict[str, tuple], after: dict[str, tuple], shown: int = 5) -> str | None:
    """What changed in what a resume reads between two fingerprints, in words (the first
    ``shown``); None if nothing. Whoever made it, any change counts: a file of a checkpoint
    already there rewritten (its ctime moves, whatever its mtime says), added or removed; a new
    iteration (while the continuation runs, its save cannot be told from the job's own); a
    tracker or the pointer written, moved or removed."""
    had = {i for i in map(_iteration, before) if i is not None}
    said, new = [], set()
    for name in sorted(before.keys() | after.keys()):
        was, now = before.get(name), after.get(name)
        if was == now:
            continue
        folder = _new_iteration(name, had)
        if name in TRACKERS:
            said.append(_tracker_change(name, was, now))
        elif folder is not None:
            if folder not in new:
                new.add(folder)
                said.append(f"{folder} appeared, a new iteration in production while the continuation ran")
        elif was is None:
            said.append(f"{name} appeared")
        elif now is None:
            said.append(f"{name} was removed")
        else:
            what = [label for label, a, b in zip(_STAT, was, now) if a != b]
            said.append(f"{name} changed ({', '.join(what)})")
    if not said:
        return None
    more = f" and {len(said) - shown} more" if len(said) > shown else ""
    return "; ".join(said[:shown]) + more


def _tracker_change(name: str, was: tuple | None, now: tuple | None) -> str:
    if was is None:
        return f"{name} appeared"
    if now is None:
        return f"{name} was removed"
    if was[-1] == now[-1]:
        moved = [label for label, a, b in zip(_STAT, was, now) if a != b]
        return f"{name} was written ({', '.join(moved)})"
    texts = [_number(v[-1]) for v in (was, now)]
    if None in texts:
        return f"{name} was rewritten"
    return f"{name} went from {texts[0]} to {texts[1]}"


def _number(content) -> int | None:
    """A tracker's iteration, if its bytes are one (``tasks.checkpoint.pointer``'s reading)."""
    found = _TRACKER_TEXT.fullmatch(content) if isinstance(content, bytes) else None
    return int(found[1]) if found else None


# ---------------------------------------------------------------- the run, watched


def _launch(script: Path, restored: Path, save_to: Path, n: int, steps: int, log: Path) -> Launch:
    """The job's script from iteration ``n`` of the restored copy (``restored``, its
    ``iter_NNNNNNN``) for ``steps`` iterations: the step passed both ways; the copy to load, the
    scratch folder to save into, where to exit and where to log in its environment."""
    env = {
        "CKPT_LOAD": os.path.realpath(restored.parent),
        "CKPT_SAVE": os.path.realpath(save_to),
        "CKPT_EXIT_INTERVAL": str(n + steps),
        "CKPT_LOG": str(log),
    }
    return Launch(script, n, ("env", "arg"), env)


@dataclass(frozen=True)
class _Run:
    """One continuation run: how it starts, the restored checkpoint it must load, its log
    (``CKPT_LOG``, which the caller keeps), the launcher's own output, and the layouts the job's
    drills loaded (its printed arguments are judged with them)."""

    profile: object
    launch: Launch
    restored: Path
    log: Path
    launcher_log: Path
    drilled: dict[tuple[int, int], str]

    @property
    def job_log(self) -> Path:
        """The Slurm job's own output (what a script that does not redirect to CKPT_LOG writes)."""
        return self.log.with_suffix(".job.log")

    @property
    def logs(self) -> list[Path]:
        """Where its arguments block is read: CKPT_LOG, the Slurm job's output, the launcher's."""
        return [self.log, self.job_log, self.launcher_log]

    def judge(self, printed: PrintedArgs, pid: int | None) -> str | None:
        """Why the run must not go on as ``printed`` says it runs (None when it may); ``pid``:
        its process here, whose working directory its relative paths are read from."""
        cwd = job_directory(pid) if pid is not None else None
        return _misfit(printed, fit_printed(printed, self.restored, self.drilled, cwd), self.launch.env, cwd)


@dataclass
class _Watch:
    """The continuation's start as Megatron-LM printed it, and why it must not go on."""

    printed: PrintedArgs | None = None
    stopped: str | None = None
    late: bool = False  # the block was read only once the run had ended
    unverified: list[Check] = field(default_factory=list)  # resumable checkpoints not read again
    done: threading.Event = field(default_factory=threading.Event)


def _where(text: str | None, cwd: Path | None) -> Path | None:
    """A printed path as the job opens it; None when it is relative and its directory unknown."""
    if text is None or text == "None":
        return None
    path = Path(text)
    if not path.is_absolute():
        if cwd is None:
            return None
        path = cwd / path
    return Path(os.path.realpath(path))


def _misfit(printed: PrintedArgs, fit: Compatibility, env: dict, cwd: Path | None) -> str | None:
    """Why the run, as Megatron-LM printed its arguments, must not go on; None when it may."""
    at = f"printed at {printed.where()}"
    save = Path(env["CKPT_SAVE"])
    for name in _SAVES:
        text = printed.get(name)
        if text is None or text == "None":
            continue
        where = _where(text, cwd)
        if where is None:
            said = f"{name} is {text}, relative, and the job's working directory is not known"
        elif where != save and (name == "save" or save not in where.parents):
            said = f"{name} is {text}" + (f" ({where})" if str(where) != text else "")
        else:
            continue
        wanted = "CKPT_SAVE" if name == "save" else "inside CKPT_SAVE"
        return f"{said}, not {wanted} {save}: it would save outside the drill's scratch ({at})"
    if _where(printed.get("load"), cwd) != Path(env["CKPT_LOAD"]):
        return (
            f"load is {printed.get('load')}, not CKPT_LOAD {env['CKPT_LOAD']}: it would not train from "
            f"the restored copy ({at})"
        )
    against = fit.refused + fit.needs_approval
    if against:
        return f"the run does not fit the checkpoint ({at}): " + "; ".join(d.words for d in against)
    return None


def _stop(run: _Run, started) -> None:
    """End the run now with SIGKILL, every process it started (those that left its session
    too, found by their environment), or its Slurm job's steps and batch script: SIGTERM would
    let Megatron-LM's ``--exit-signal-handler`` save on its way out, into whatever ``--save`` it
    printed."""
    if started is None:
        cancel(run.launcher_log, hard=True)
        return
    process.terminate(started.pid, hard=True, token=started.token)


def _watch(run: _Run, watch: _Watch, started) -> None:
    """Read the arguments block from the run's output (``CKPT_LOG``, else the Slurm job's or the
    launcher's) as soon as it is there, and stop a run that does not fit. A block read only once
    the run has ended is judged after it (``_run_watched``)."""
    try:
        watch.printed = watch_printed(run.logs, math.inf, lambda: not watch.done.is_set())
        watch.late = watch.done.is_set()
        if watch.printed is None or watch.late:
            return
        watch.stopped = run.judge(watch.printed, getattr(started, "pid", None))
    except Exception as e:  # a watch that cannot judge must not let the run go on unjudged
        watch.stopped = f"{run.log}: its arguments block could not be judged: {type(e).__name__}: {e}"
    if watch.stopped is not None:
        _stop(run, started)


def _run_watched(run: _Run) -> _Watch:
    """The job's script to its end, or until the watch stops it: with bash here, or submitted
    to the drill's partition and account on Slurm (its own ``#SBATCH`` lines size it: a
    comparison needs the original's world). Whatever it started ends with it (its process
    groups; on Slurm, the job)."""
    drill, watch = run.profile.drill, _Watch()
    timeout, what = drill.continuation.timeout_seconds, "the continuation run"
    started = run.launch.start(run.launcher_log) if drill.launcher != "slurm" else None
    watcher = threading.Thread(target=_watch, args=(run, watch, started))
    watcher.start()
    try:
        if started is not None:
            process.wait(started, run.launcher_log, timeout, what)
        else:
            options = [
                f"--job-name=ckptops-continue-{run.profile.job.name}",
                *allocation_options(drill.slurm),
            ]
            arguments = run.launch.sbatch_arguments(options, run.job_log)
            sbatch_wait(arguments, run.launcher_log, timeout, what, run.launch.environ())
    except process.Failed:
        if watch.stopped is None:
            raise
    finally:
        watch.done.set()
        watcher.join()
    if watch.late and watch.printed is not None:  # it printed its block and ended before the watch read it
        late = run.judge(watch.printed, None)
        watch.stopped = late and f"{late}; it ended before the block was read"
    elif watch.stopped is not None:
        watch.stopped += "; stopped before its first iteration"
    return watch


def _evidence(output: Path, after: Steps, n: int, steps: int, copy: Path, began: float) -> Check | None:
    """Why the run's log is no evidence that this copy resumed (None when it is): Megatron-LM
    says it loaded iteration ``n`` from ``copy``, and the iterations it trained are stamped after
    ``began`` (the drill's start, seconds since the epoch)."""
    loaded = []
    with open(output, errors="replace") as lines:
        for line in lines:
            found = _LOADED.search(line.rstrip("\n"))
            if found:
                loaded.append((found[1].strip(), int(found[2])))
    if not any(_where(where, None) == copy and iteration == n for where, iteration in loaded):
        seen = ", ".join(f"{i} from {w}" for w, i in loaded) or "no such line"
        return Check(
            EVIDENCE,
            Outcome.FAIL,
            f"{output}: Megatron-LM does not say it loaded iteration {n} from the restored copy: "
            "not certified",
            f"successfully loaded checkpoint from {copy} ... at iteration {n}",
            seen,
        )
    rows = [i for i, it in enumerate(after.iteration) if n < it <= n + steps]
    stale = [int(after.iteration[i]) for i in rows if not after.time[i] >= began]
    if stale:
        return Check(
            EVIDENCE,
            Outcome.FAIL,
            f"{output}: iteration {stale[0]} is not stamped after the drill began: not certified",
            "iteration lines printed during this drill",
            f"{len(stale)} of {len(rows)} before it or without a time",
        )
    return None


def _exit_save(save_to: Path, last: int) -> Check | None:
    """Why ``CKPT_SAVE`` holds no save of iteration ``last`` (None when it does): Megatron-LM,
    given ``--save``, saves when it exits at ``--exit-interval``; a log printed without training
    leaves none."""
    tracker = save_to / layout.MEGATRON_TRACKER
    try:
        said = tracker.read_text(errors="replace").strip()
    except OSError:
        said = None
    saved = save_to / layout.iter_dir_name(last)
    if said == str(last) and saved.is_dir() and any(saved.iterdir()):
        return None
    return Check(
        EVIDENCE,
        Outcome.FAIL,
        f"{save_to}: the continuation printed save {save_to} but saved no checkpoint of iteration {last} "
        "there, as Megatron-LM does when it exits at --exit-interval: not certified",
        f"{layout.iter_dir_name(last)} and a tracker at {last}",
        f"tracker {said}" if said is not None else "no tracker",
    )


def continue_training(
    profile,
    sources: tuple[Path, Steps],
    restored: Path,
    scratch: Path,
    steps: int,
    log: Path,
    manifest: Manifest,
    began: float,
) -> Continued:
    """Train ``steps`` iterations on from the restored checkpoint ``restored`` (its
    ``iter_NNNNNNN`` directory, copied by ``manifest``) with ``sources``
    (``continuation_sources``: the script and the original run's log) and compare. The run's
    output goes to ``log``, which the caller keeps; ``began``: when the drill began (seconds
    since the epoch), which the run's iterations must be stamped after."""
    script, before = sources
    facts = checkpoint_facts(restored)
    facts.data_version = manifest.data_version  # the copy has the files, the job's manifest the facts
    n = facts.iteration
    unlogged = _not_logged_yet(before, n, steps)
    if unlogged is not None:
        return unlogged
    save_to = scratch / "continuation-save"
    save_to.mkdir()
    launch = _launch(script, restored, save_to, n, steps, log)
    drilled = drilled_layouts(profile.job.save_dir)
    fits = checkpoint_fit(profile, restored, script, launch.environ(), drilled)
    if fits.refused or fits.needs_approval:
        # The drill fails, and the checkpoint is not blamed (not checked, nothing certified): the
        # script would not resume it as the original run went.
        said = f"{script} does not fit checkpoint {n}: " + "; ".join(
            d.words for d in fits.refused + fits.needs_approval
        )
        return Continued(Outcome.UNCHECKED, "not run", [Check(ARGUMENTS, Outcome.FAIL, said)])
    run = _Run(profile, launch, restored, log, scratch / "continuation-launcher.log", drilled)
    watch = _run_guarded(run)
    if isinstance(watch, Continued):
        return watch
    after = _trained(run, watch, n, steps, began, save_to)
    if isinstance(after, Continued):
        after.checks += watch.unverified
        return after
    warned = [Check(ARGUMENTS, Outcome.WARN, d.words) for d in fits.of(Kind.WARN)] + watch.unverified
    return _compared(profile, facts, before, after, steps, warned)


def _not_logged_yet(before: Steps, n: int, steps: int) -> Continued | None:
    """Not checkable yet when the original run (``before``) has not logged the ``steps``
    iterations after ``n``; None when it has."""
    logged = {int(i) for i in before.iteration}
    if set(range(n + 1, n + steps + 1)) <= logged:
        return None
    last = max(logged, default=0)
    return Continued(
        Outcome.UNCHECKED,
        f"not checkable yet: the original run has logged up to iteration {last}, "
        f"the {steps} after {n} are needed",
    )


def _run_guarded(run: _Run) -> _Watch | Continued:
    """The run, watched, with the job's save directory fingerprinted before and after and its
    resumable checkpoints read again whole after it, whatever its outcome: not certified when
    anything changed there (``touched``, for the caller's alarm) or when its printed arguments
    stopped it; a run that failed otherwise raises, once the save directory was seen. Those that
    could not be read again are warned of (``unverified``)."""
    save_dir = run.profile.job.save_dir
    ours = {run.log, run.job_log}
    resumable, skipped = _resumable(run.profile, layout.parse_iter_dir(run.restored.name))
    unverified = [Check(PRODUCTION, Outcome.WARN, line) for line in skipped]
    untouched = fingerprint(save_dir, ours)
    failure = watch = None
    try:
        watch = _run_watched(run)
    except (CkptopsError, OSError) as e:  # exited non-zero, timed out: production is looked at first
        failure = e
    touched = changes(untouched, fingerprint(save_dir, ours))
    said = [f"{save_dir}: the continuation changed the job's save directory: {touched}"] if touched else []
    said += _reverified(run.profile, resumable)
    if said:
        checks = unverified + [Check(PRODUCTION, Outcome.FAIL, line) for line in said]  # the alarm's last
        return Continued(Outcome.UNCHECKED, "not certified", checks, touched="; ".join(said))
    if isinstance(failure, process.Failed) and _written(run.log):
        raise CkptopsError(
            f"{run.log}: the continuation run exited {failure.code}: {process.tail(run.log)}"
        ) from None
    if failure is not None:
        raise failure
    if watch.stopped is not None:
        stopped = Check(PRINTED, Outcome.FAIL, watch.stopped)
        return Continued(Outcome.UNCHECKED, "not certified", [stopped, *unverified])
    watch.unverified = unverified
    return watch


def _resumable(profile, drilled: int | None) -> tuple[list[tuple[Path, Manifest]], list[str]]:
    """The job's checkpoints a resume may take, each with the manifest it is valid by, read
    before the continuation: the promoted one and the one drilled (the drill certifies it),
    where its manifest says valid for the save on disk; and one line for each of them that
    cannot be read again after the run, and why (a pointer that cannot be read, a manifest that
    is missing, unreadable, or not for the save on disk; a drilled checkpoint no longer there is
    no resume's)."""
    save_dir, trust = profile.job.save_dir, Trust.of(profile)
    found, skipped = [], []
    try:
        promoted = read_pointer(save_dir)
    except CkptopsError as e:
        promoted = None  # a garbled pointer: its bytes are fingerprinted all the same
        skipped.append(f"the promoted checkpoint will not be re-verified after the continuation: {e}")
    for iteration in sorted({i for i in (promoted, drilled) if i is not None}):
        directory = save_dir / layout.iter_dir_name(iteration)
        which = "promoted" if iteration == promoted else "drilled"
        if which == "drilled" and not os.path.lexists(directory):
            continue  # drilled from the archive, gone from the save directory: no resume takes it
        try:
            manifest = valid_for_this_save(directory, iteration, trust)
            why = None if manifest is not None else _not_valid_for_this_save(directory, iteration, trust)
        except (CkptopsError, OSError) as e:
            manifest, why = None, f"its manifest cannot be read ({e})"
        if manifest is not None:
            found.append((directory, manifest))
        else:
            skipped.append(
                f"{directory}: the {which} checkpoint will not be re-verified after the continuation: {why}"
            )
    return found, skipped


def _not_valid_for_this_save(directory: Path, iteration: int, trust: Trust) -> str:
    """Why ``valid_for_this_save`` found no manifest to verify ``directory`` by."""
    try:
        manifest = read_manifest(directory, trust)
    except (CkptopsError, OSError) as e:
        return f"its manifest cannot be read ({e})"
    if manifest is None:
        return "it has no manifest"
    if not manifest.valid:
        return "its manifest says invalid"
    return (
        f"its manifest is not for the save on disk (iteration {manifest.iteration}, a linked directory, "
        "or files saved again since)"
    )


def _reverified(profile, resumable: list[tuple[Path, Manifest]]) -> list[str]:
    """Each of ``resumable`` read again, every byte, against the manifest it was valid by
    (``verify_checkpoint`` with it as the reference: hashes, not stats): one line for each that
    no longer matches, naming the file."""
    options = VerifyOptions.from_profile(profile)  # the profile's engine, threads and hashing
    said = []
    for directory, manifest in resumable:
        try:
            result = verify_checkpoint(directory, options, reference=manifest)
        except CkptopsError as e:
            said.append(f"{directory}: cannot be verified again after the continuation: {e}")
            continue
        if result.state is not State.VALID:
            failing = next((c for c in result.checks if c.failed and c.file), None)
            where = directory / failing.file if failing is not None else directory
            said.append(f"{where}: no longer matches its manifest after the continuation: {result.reason}")
    return said


def _trained(run: _Run, watch: _Watch, n: int, steps: int, began: float, save_to: Path) -> Steps | Continued:
    """What the run trained, read from its output (``CKPT_LOG``, the Slurm job's, else the
    launcher's), once it is evidence: Megatron-LM printed its arguments, loaded iteration ``n``
    from the copy and trained after the drill ``began``, and, having reached its exit with a
    save printed, saved there (``save_to``). Not certified otherwise."""
    output = next((p for p in (run.log, run.job_log) if _written(p)), run.launcher_log)
    if watch.printed is None:
        said = (
            f"{output}: Megatron-LM printed no arguments block: what the run trained with is not "
            "known, not certified"
        )
        return Continued(Outcome.UNCHECKED, "not certified", [Check(PRINTED, Outcome.FAIL, said)])
    after = load_steps(output)
    evidence = _evidence(output, after, n, steps, Path(run.launch.env["CKPT_LOAD"]), began)
    if evidence is not None:
        return Continued(Outcome.UNCHECKED, "not certified", [evidence])
    reached = int(after.iteration.max()) if len(after) else n
    if reached >= n + steps and watch.printed.get("save") not in (None, "None"):
        unsaved = _exit_save(save_to, n + steps)
        if unsaved is not None:
            return Continued(Outcome.UNCHECKED, "not certified", [unsaved])
    return after


def _compared(profile, facts, before: Steps, after: Steps, steps: int, warned: list[Check]) -> Continued:
    """The continued run (``after``) against the original run's log over the ``steps``
    iterations after the checkpoint, by the checks any run started from one gets
    (``tasks.relaunch.continuity``) at ``drill.continuation.tolerance``; ``warned``: the script's
    own warnings, kept with them."""
    n, tolerance = facts.iteration, profile.drill.continuation.tolerance
    first, later = TOLERANCES[tolerance]
    settings = profile.resume.model_copy(update={"loss_rel_tolerance": later, "first_rel_tolerance": first})
    validation = Continuity(facts, before, after, settings).continuation()
    checks, largest = warned + validation.checks, validation.largest_difference
    drawn = series(before, after, n + 1, n + steps)
    failed = [c for c in checks if c.failed]
    reached = int(after.iteration.max()) if len(after) else n
    if reached < n + steps:
        stopped = f"the continuation stopped at iteration {reached}, before {n + steps}"
        return Continued(Outcome.FAIL, stopped, checks, largest, drawn)
    if failed:
        differ = f"iterations {n + 1}-{n + steps} differ from the original run ({failed[0].name})"
        return Continued(Outcome.FAIL, differ, checks, largest, drawn)
    return Continued(
        Outcome.PASS,
        f"iterations {n + 1}-{n + steps} trained from the restored copy match the original run's log "
        f"({tolerance})",
        checks,
        largest,
        drawn,
    )


def _written(log: Path) -> bool:
    return log.is_file() and log.stat().st_size > 0


def series(before: Steps, after: Steps, first: int, last: int) -> dict:
    """Iterations ``first``..``last`` with each run's loss and learning rate (None where a run
    did not log one; an iteration's last record wins, a rerun's), for the drill's plot."""

    def by_iteration(steps: Steps, name: str) -> dict[int, float]:
        values = getattr(steps, name)
        return {int(i): float(v) for i, v in zip(steps.iteration, values) if first <= i <= last}

    iterations = list(range(first, last + 1))
    drawn = {"iteration": iterations}
    for side, steps in (("original", before), ("continued", after)):
        for name in ("loss", "lr"):
            found = by_iteration(steps, name)
            drawn[f"{side}_{name}"] = [
                found[i] if i in found and math.isfinite(found[i]) else None for i in iterations
            ]
    return drawn
