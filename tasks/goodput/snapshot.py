"""The job as goodput sees it, read once a command or flow run: its steps (the Megatron-LM log
named, else the step records the profile points at), its newest checkpoint with the two facts
goodput takes from it and its size, its incidents and its blocking save times. The ledger, the
advice and the calendar read the job only through this snapshot; every read goodput makes of the
job's checkpoints, records and incident ledger is in ``read_job``."""

from dataclasses import dataclass
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.saves import store_save_seconds
from tasks.checkpoint.signing import Trust
from tasks.errors import CkptopsError, Malformed, Unreadable, UsageError, unreadable
from tasks.goodput.measure import Figure, save_times_from_records
from tasks.job import step_records
from tasks.job.save_log import SaveLog, read_save_log_file
from tasks.job.step_records import Steps, load_steps
from tasks.recovery.ledger import Incident, read_ledger
from tasks.storage.local import list_files


@dataclass(frozen=True)
class JobSnapshot:
    name: str
    gpus: int  # recovery.gpus, else the job's world size
    log: Path | None  # the Megatron-LM log the user named
    steps: Steps | None  # None: no log with iteration lines and no step records
    newest: Path | None  # the promoted checkpoint, else the highest iteration saved
    seq_length: int | None  # from the newest checkpoint's args (None: none, or not readable)
    save_interval: int | None
    checkpoint_bytes: Figure  # the newest checkpoint's size (in Figure.seconds' place)
    incidents: tuple[Incident, ...]  # this job's, from the save directory's incident ledger
    save_times: tuple[float, ...]  # blocking saves, in seconds
    save_source: str
    save_log: SaveLog | None = None  # the saves of the log the save times came from
    store_saves: tuple[float, ...] = ()  # each complete save's first data file to its .metadata, s


def read_job(profile, log: Path | None = None, warn=None) -> JobSnapshot:
    """The profile's job, each of its sources read once; ``warn`` gets the incident ledger's
    lines that could not be used."""
    save_dir = profile.job.save_dir
    trust = Trust.of(profile)  # its manifests' signatures checked as the profile says
    steps = _steps(profile, log)
    newest = _newest_checkpoint(save_dir)
    seq_length, save_interval = _facts(newest, trust)
    read = read_ledger(save_dir)
    for problem in read.problems if warn else ():
        warn(problem)
    saves, save_source, save_log = _save_times(steps, log, save_interval)
    recovery_gpus = profile.recovery.gpus if profile.recovery else None
    return JobSnapshot(
        profile.job.name,
        recovery_gpus or profile.job.layout.world_size,
        log,
        steps,
        newest,
        seq_length,
        save_interval,
        _checkpoint_size(save_dir, newest, trust),
        tuple(i for i in read.incidents if i.job == profile.job.name),
        tuple(saves),
        save_source,
        save_log,
        tuple(store_save_seconds(save_dir)) if save_dir.is_dir() else (),
    )


def _steps(profile, log: Path | None) -> Steps | None:
    """The steps to measure: the Megatron-LM log the user named (its iteration lines carry their
    times), else (no log, or one without iteration lines) the profile's step records."""
    if log is not None:
        try:
            return load_steps(log)
        except UsageError:
            pass  # its save timers may still be there; the steps come from the records
    records = step_records.configured(profile)
    if records is None or not Path(records).exists():
        return None
    return load_steps(records)


def _newest_checkpoint(save_dir: Path) -> Path | None:
    if not save_dir.is_dir():
        return None
    pointer = read_pointer(save_dir)
    if pointer is not None:
        return save_dir / layout.iter_dir_name(pointer)
    found = layout.list_iterations(save_dir)
    return save_dir / layout.iter_dir_name(max(found)) if found else None


def _facts(newest: Path | None, trust: Trust) -> tuple[int | None, int | None]:
    """The newest checkpoint's --seq-length and --save-interval from its args (None without a
    checkpoint, then torch is never imported, or one that cannot be read or trusted)."""
    if newest is None:
        return None, None
    from tasks.checkpoint.facts import checkpoint_facts

    try:
        facts = checkpoint_facts(newest, trust)
    except (UsageError, Unreadable, Malformed):  # Malformed: a manifest not to trust
        return None, None
    return facts.seq_length, facts.save_interval


def _checkpoint_size(save_dir: Path, newest: Path | None, trust: Trust) -> Figure:
    """The newest checkpoint's size in bytes: its manifest's file sizes, else its files on disk."""
    if newest is None or not newest.is_dir():
        return Figure(None, f"not measured: no checkpoint in {save_dir}")
    try:
        manifest = read_manifest(newest, trust)
    except CkptopsError:  # a manifest not to trust: the files on disk still have their sizes
        manifest = None
    if manifest is not None and manifest.files:
        return Figure(float(sum(f.size for f in manifest.files)), f"manifest of {newest.name}")
    try:
        files = list_files(newest)
    except OSError as e:
        raise unreadable(newest, e) from None
    total = sum(st.st_size for st in files.values())
    return Figure(float(total), f"files of {newest.name} on disk") if total else Figure(None, "not measured")


def _save_times(
    steps: Steps | None, log: Path | None, save_interval: int | None
) -> tuple[list[float], str, SaveLog | None]:
    """Blocking save times, where they came from and that log's saves, the best source first:
    Megatron-LM's ``save-checkpoint`` timers in the job's log (``log``, else the log the steps
    came from), then the step loop held after each save in its step records. Never the
    checkpoints' file times for the blocking part: they span an async save's background write
    (and ckptops's own writes after it); ``store_saves`` reports those apart."""
    logs = [log] if log is not None else []
    if steps is not None and steps.kind == "megatron-log" and Path(steps.source) not in logs:
        logs.append(Path(steps.source))
    for path in logs:
        saves = read_save_log_file(path)
        if saves.blocking:
            return saves.blocking, f"save timers in {path}", saves
    if steps is not None and steps.kind == "records":
        found = save_times_from_records(steps, save_interval)
        if found:
            return found, f"step loop held after each save, {steps.source}", None
    return [], "not measured: no save-checkpoint timer in the job's log (--log) and no step records", None
