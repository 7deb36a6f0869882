"""Thin Prefect wrappers around the checkpoint code, and the artifacts the UI shows.

The promotion cycle's steps as Prefect tasks (``PrefectSteps``, which verify-and-promote hands to
tasks.checkpoint.promote.promote), the job's concurrency slot, and the run's artifacts. One task
per checkpoint step, never one per file: a checkpoint has thousands of files, and Prefect's
task-run bookkeeping (20-45 ms each, a SQLite database behind it) would cost more than the
hashing. Files are parallelised inside ``verify_checkpoint`` with threads instead.
"""

import contextvars
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

from prefect import get_client, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.concurrency.sync import concurrency

from tasks.checkpoint import layout
from tasks.checkpoint.catalog import catalog
from tasks.checkpoint.content import worst_tensors
from tasks.checkpoint.lock import Held
from tasks.checkpoint.manifest import RESUME_WORDS
from tasks.checkpoint.promote import Here, PromotionReport, Waiting
from tasks.checkpoint.retention import RetentionPlan
from tasks.checkpoint.saves import SaveState, saves_of
from tasks.checkpoint.state import Completeness, State, VerifyOptions
from tasks.checkpoint.trackers import alarm_lines, tracker_alarms
from tasks.checkpoint.verify import Verification
from tasks.storage.local import list_files

_PROGRESS_EVERY_SECONDS = 1.0
_SHARD_TABLE_EVERY_SECONDS = 5.0
# Prefect's slot acquisition needs a moment even when the slot is free.
_MIN_SLOT_WAIT_SECONDS = 30


def job_limit_name(job: str) -> str:
    return f"ckptops-job-{job}"


@task(name="ensure-job-limit")
def ensure_job_limit(job: str) -> str:
    """The global concurrency limit (one slot) that serialises runs on one job across workers."""
    name = job_limit_name(job)
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, 1)
    return name


@contextmanager
def job_slot(job: str, lock_timeout_seconds: float):
    """Hold the job's concurrency slot: it serialises runs on one job across workers and shows who
    waits in the UI (the job lock also keeps out the CLI and runs from other Prefect servers)."""
    slot_timeout = max(lock_timeout_seconds, _MIN_SLOT_WAIT_SECONDS)
    with concurrency(ensure_job_limit(job), occupy=1, strict=True, timeout_seconds=slot_timeout):
        yield


@task(name="wait-for-save", task_run_name="wait-{iteration}")
def wait_for_save(save_dir: Path, iteration: int, options: VerifyOptions, waiting: Waiting) -> Completeness:
    return Here().wait(save_dir, iteration, options, waiting)


class _ByteCounter:
    """Counts bytes verified, and keeps the Slurm engine's latest shard table and news; called
    from the verifier's threads, read by the task's thread (the one that may talk to Prefect)."""

    def __init__(self):
        self.done = 0
        self.rows: list[dict] = []
        self.events: list[str] = []
        self.changed = False
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n

    def watch(self, statuses, events: list[str]) -> None:
        with self._lock:
            self.rows = [s.row() for s in statuses]
            self.events += events
            self.changed = self.changed or bool(events)

    def take(self, table_due: bool) -> tuple[list[dict], list[str]]:
        """The news since the last take, and the shard table when it is due and has changed since
        it was last taken (else empty: it stays pending)."""
        with self._lock:
            rows = self.rows if self.changed and table_due else []
            self.changed = self.changed and not rows
            events, self.events = self.events, []
            return rows, events


@task(name="verify-checkpoint", task_run_name="verify-{iteration}")
def verify_one(
    save_dir: Path, iteration: int, options: VerifyOptions, held: Held, waiting: Waiting | None
) -> Verification:
    """Verify one checkpoint and record the verdict (``held``: the job lock) while a progress
    artifact follows it in the UI; with ``waiting`` (``overlap_save``), wait for its save first,
    reading its data files as they settle.

    The verification runs in a helper thread; this (the task's) thread owns the Prefect context
    and updates the artifact once a second, so the hashing threads never wait on the API.
    """
    directory = save_dir / layout.iter_dir_name(iteration)
    total = max(1, sum(st.st_size for st in list_files(directory).values()))
    artifact = create_progress_artifact(
        progress=0.0,
        description=f"verifying {directory.name} ({total / 1e9:.2f} GB, {options.engine} engine)",
    )
    counter = _ByteCounter()
    logger = get_run_logger()
    published = 0.0
    with ThreadPoolExecutor(max_workers=1) as pool:
        here = Here(counter, counter.watch)
        future = pool.submit(
            contextvars.copy_context().run, here.verify, save_dir, iteration, options, held, waiting
        )
        while True:
            finished = wait([future], timeout=_PROGRESS_EVERY_SECONDS).done
            update_progress_artifact(artifact, progress=min(100.0, 100.0 * counter.done / total))
            # The per-shard table, as the shards finish, fail or move: a new version at most
            # every few seconds (each is a row in Prefect's database).
            rows, events = counter.take(
                finished or time.monotonic() - published >= _SHARD_TABLE_EVERY_SECONDS
            )
            for line in events:
                logger.info(line)
            if rows:
                _publish_shards(options.job, directory.name, rows)
                published = time.monotonic()
            if finished:
                break
    update_progress_artifact(artifact, progress=100.0)
    return future.result()


def _publish_shards(job: str, checkpoint: str, rows: list[dict]) -> None:
    create_table_artifact(
        table=rows,
        key=f"verify-shards-{job}",
        description=f"{checkpoint}: shards and the nodes that read them",
    )


@task(name="promote")
def promote_step(save_dir: Path, options: VerifyOptions, requested: int | None) -> PromotionReport:
    return Here().promote(save_dir, options, requested)


@task(name="retention")
def retention(save_dir: Path, options: VerifyOptions, keep_verified: int) -> tuple[RetentionPlan, list[int]]:
    return Here().retain(save_dir, options, keep_verified)


class PrefectSteps:
    """The promotion cycle's steps (tasks.checkpoint.promote.Steps) as Prefect tasks: each wait,
    verification, promotion and retention a task run the UI shows, each verification with its
    progress artifact and, on the Slurm engine, its shard table."""

    def wait(self, save_dir: Path, iteration: int, options: VerifyOptions, waiting: Waiting) -> Completeness:
        return wait_for_save(save_dir, iteration, options, waiting)

    def verify(
        self, save_dir: Path, iteration: int, options: VerifyOptions, held: Held, waiting: Waiting | None
    ) -> Verification:
        return verify_one(save_dir, iteration, options, held, waiting)

    def promote(self, save_dir: Path, options: VerifyOptions, requested: int | None) -> PromotionReport:
        return promote_step(save_dir, options, requested)

    def retain(
        self, save_dir: Path, options: VerifyOptions, keep_verified: int
    ) -> tuple[RetentionPlan, list[int]]:
        return retention(save_dir, options, keep_verified)


def check_rows(verifications: list[Verification]) -> list[dict]:
    return [
        {
            "iteration": v.iteration,
            "check": c.name,
            "result": c.outcome.value.upper() if c.failed else c.outcome.value,
            "file": c.file or "",
            "detail": c.detail,
        }
        for v in verifications
        for c in v.checks
    ]


def summary_markdown(job: str, save_dir: Path, report: PromotionReport) -> str:
    verifications, plan, deleted = report.verifications, report.retention, report.deleted
    lines = [
        f"# verify-and-promote: {job}",
        "",
        f"- save directory: `{save_dir}`",
        f"- latest verified: **{report.current}** (was {report.previous}; {report.message})",
        *(f"- **not promoted**: `{line}`" for line in report.refused),
        "",
    ]
    checked = [v for v in verifications if v.state is not State.IN_PROGRESS]
    if checked:
        lines += [
            "| iteration | state | files | GB | seconds | GB/s | reason | manifest signed by |",
            "|---:|---|---:|---:|---:|---:|---|---|",
        ]
        for v in checked:
            files = v.manifest.totals["files"] if v.manifest else 0
            state = v.state.value + (RESUME_WORDS[v.manifest.resumes] if v.manifest else "")
            lines.append(
                f"| {v.iteration} | {state} | {files} | {v.bytes_read / 1e9:.3f} | "
                f"{v.seconds:.2f} | {v.throughput_gbps:.2f} | {v.reason} | {v.signed_by or 'not signed'} |"
            )
        total_bytes = sum(v.bytes_read for v in checked)
        total_seconds = sum(v.seconds for v in checked)
        rate = total_bytes / total_seconds / 1e9 if total_seconds else 0.0
        lines += [
            "",
            f"Totals: {len(checked)} checkpoints, {total_bytes / 1e9:.3f} GB read "
            f"in {total_seconds:.2f} s ({rate:.2f} GB/s).",
        ]
    else:
        lines.append("No new complete checkpoint to verify.")
    for v in verifications:
        if v.state is State.IN_PROGRESS:
            lines.append(
                f"- iteration {v.iteration} still in progress after the wait ({v.reason}); "
                "the next run picks it up"
            )
    if plan is not None:
        lines.append(
            f"- retention (keep {plan.keep_verified}): deleted {deleted or 'nothing'}; "
            f"failed kept for inspection: {plan.invalid or 'none'}"
        )
        lines += [f"- expired lease removed: {lease}" for lease in plan.expired_leases]
    return "\n".join(lines) + "\n"


def tensor_rows(verifications: list[Verification]) -> list[dict]:
    """Per checkpoint verified, its worst tensors (non-finite first, then the largest norm change)."""
    return [
        {"iteration": v.iteration, **row}
        for v in verifications
        if v.manifest is not None and v.manifest.tensors
        for row in worst_tensors(v.manifest.tensors)
    ]


def publish(job: str, save_dir: Path, report: PromotionReport) -> None:
    """The run's artifacts: the checks per checkpoint, its worst tensors, the summary."""
    verifications = report.verifications
    publish_report(
        job, check_rows(verifications), summary_markdown(job, save_dir, report), tensor_rows(verifications)
    )


@task(name="publish-report")
def publish_report(job: str, rows: list[dict], markdown: str, tensors: list[dict] = ()) -> None:
    if rows:
        create_table_artifact(table=rows, key=f"verify-checks-{job}", description="checks per checkpoint")
    if tensors:
        create_table_artifact(
            table=list(tensors),
            key=f"verify-tensors-{job}",
            description="worst tensors per checkpoint: NaN or Inf first, then the largest norm change",
        )
    create_markdown_artifact(
        markdown=markdown, key=f"verify-summary-{job}", description="verify-and-promote summary"
    )


def _variable(job: str) -> str:
    """The Prefect Variable that remembers which save alarms were sent (lowercase, [a-z0-9_-])."""
    return "ckptops-save-alarms-" + re.sub(r"[^a-z0-9_-]", "-", job.lower())


@task(name="save-health")
def save_health(profile, options: VerifyOptions) -> list[str]:
    """Each save's state in the profile's save directory, from the store and the job's log, and
    the trackers a plain ``--load`` resumes from (``tasks.checkpoint.trackers``): a table
    artifact of the saves not complete, a warning in the run's log for each alarm, and a
    notification through ``notify.block`` for each alarm not notified before (what was sent is
    kept in a Prefect Variable, so a stalled save is told once, not every run). The alarms'
    lines."""
    from prefect.variables import Variable

    from tasks import notify

    report = saves_of(profile, profile.job.save_dir, options)
    rows = [
        {"iteration": s.iteration, "state": s.state.value, "files": s.files, "reason": s.reason}
        for s in report.saves
        if s.state is not SaveState.COMPLETE
    ]
    everything = [{"iteration": "", "state": "all complete", "files": "", "reason": report.space.line()}]
    create_table_artifact(
        table=rows or everything,
        key=f"saves-{re.sub(r'[^a-z0-9-]', '-', profile.job.name.lower())}",
        description=f"saves of {profile.job.name} not complete; {report.space.line()}",
    )
    save_dir = profile.job.save_dir
    alarms = alarm_lines(report, tracker_alarms(save_dir, catalog(save_dir, options), options))
    logger = get_run_logger()
    for line in alarms.values():
        logger.warning(line)
    sent = set(Variable.get(_variable(profile.job.name), default=[]) or [])
    new = [line for key, line in alarms.items() if key not in sent]
    if new:
        problem = notify.send(profile, "a checkpoint save needs a person", "\n".join(new))
        if problem:
            logger.warning(problem)
    if set(alarms) != sent:
        Variable.set(_variable(profile.job.name), sorted(alarms), overwrite=True)
    return list(alarms.values())
