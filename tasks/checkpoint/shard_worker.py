"""One task of the Slurm verify engine: read one shard of a checkpoint and write its result.

srun starts it on every node: ``python -m tasks.checkpoint.shard_worker PLAN --attempt A``, each
task taking its shard from ``SLURM_PROCID`` (a retry names it with ``--shard``). It needs ckptops
installed and the work directory and checkpoint visible, nothing else: no Prefect server, no
database. The bytes are read with the same code as on one host (``scan.scan_file``).

Exit 0: the shard was read (its result says what was found, failures included); 3: it could not
be read on this node, and its result (when the work directory is writable) says why.
"""

import argparse
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tasks.checkpoint.scan import scan_file
from tasks.checkpoint.shards import PieceResult, ShardPlan, ShardResult, progress_path, read_records
from tasks.storage.local import atomic_write

CANNOT_READ = 3
_PROGRESS_EVERY_SECONDS = 1.0


class _Counter:
    """Bytes read so far, shared by the reading threads; holds them to ``max_bytes_per_second``."""

    def __init__(self, max_bytes_per_second: float | None):
        self.done = 0
        self.rate = max_bytes_per_second
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            ahead = self.done / self.rate - (time.monotonic() - self.started) if self.rate else 0
        if ahead > 0:
            time.sleep(ahead)  # a rate limit, not synchronisation


class CannotRead(Exception):
    """This node cannot read the shard (not visible, I/O error): the environment's fault."""


def read_shard(plan: ShardPlan, shard_index: int, attempt: int, node: str, work: Path) -> ShardResult:
    shard = plan.shards[shard_index]
    directory = Path(plan.directory)
    counter = _Counter(plan.max_read_mbps * 1e6 if plan.max_read_mbps else None)
    started = time.monotonic()
    stop = threading.Event()
    reporter = threading.Thread(
        target=_report_progress, args=(work, shard_index, attempt, node, counter, stop), daemon=True
    )
    reporter.start()
    try:
        if not directory.is_dir():
            raise CannotRead(f"{directory}: not visible on node {node}")
        records = read_records(work, shard_index)

        def read(piece):
            # A shard holds at most one span of a file: its records there are the span's own.
            scan = scan_file(
                directory / piece.name,
                records.get(piece.name, []),
                piece.sha256,
                counter,
                plan.hashing,
                (piece.start, piece.end),
                uncached=plan.drop_cache,
                name=piece.name,
            )
            if scan.unreadable is not None:
                error = scan.unreadable
                raise CannotRead(f"{directory / piece.name}: {error.strerror or error} on node {node}")
            return PieceResult.of(scan)

        threads = max(1, min(len(shard.pieces), len(os.sched_getaffinity(0))))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            pieces = list(pool.map(read, shard.pieces))
        return ShardResult(shard_index, attempt, node, time.monotonic() - started, counter.done, pieces)
    except CannotRead as e:
        return ShardResult(shard_index, attempt, node, time.monotonic() - started, counter.done, error=str(e))
    finally:
        stop.set()
        reporter.join()
        _write_progress(work, shard_index, attempt, node, counter.done)


def _write_progress(work: Path, shard: int, attempt: int, node: str, done: int) -> None:
    path = progress_path(work, shard, attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The step id lets the coordinator cancel this task in Slurm if its srun cannot end it.
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    note = {
        "node": node,
        "pid": os.getpid(),
        "bytes": done,
        "step": f"{job}.{step}" if job and step else None,
    }
    atomic_write(path, json.dumps(note).encode())


def _report_progress(work, shard, attempt, node, counter, stop) -> None:
    while True:
        _write_progress(work, shard, attempt, node, counter.done)
        if stop.wait(_PROGRESS_EVERY_SECONDS):
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shard_worker", description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--shard", type=int, help="default: this task's, from SLURM_PROCID")
    args = parser.parse_args(argv)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    work = args.plan.parent
    try:
        plan = ShardPlan.read(args.plan)
    except (OSError, ValueError, TypeError, KeyError) as e:
        print(f"shard_worker: {args.plan}: cannot read the plan on node {node} ({e})", file=sys.stderr)
        return CANNOT_READ
    shard = (
        args.shard
        if args.shard is not None
        else plan.shard_for_task(int(os.environ.get("SLURM_PROCID", "0")))
    )
    result = read_shard(plan, shard, args.attempt, node, work)
    try:
        result.write(work)
    except OSError as e:
        print(f"shard_worker: shard {shard}: cannot write its result on node {node} ({e})", file=sys.stderr)
        return CANNOT_READ
    if result.error:
        print(f"shard_worker: shard {shard}: {result.error}", file=sys.stderr)
        return CANNOT_READ
    return 0


if __name__ == "__main__":
    sys.exit(main())
