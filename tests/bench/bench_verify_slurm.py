"""``make bench``: the Slurm verify engine against the local one, on the bench checkpoint and the
local Slurm cluster (``make slurm``: nodes n1-n3, all on this machine), beside plain reads measured
in the same run.

What it gives:
- the overhead of the Slurm engine (srun, the shard tasks' start, polling, merging): the 1-node
  Slurm engine minus the local engine, both reading from the page cache;
- the per-node verification rate: each shard task's own bytes over its own reading time;
- the same with every task dropping its node's cache first (``drop_cache``, the default), against
  a cold plain read.

All three "nodes" share this machine's cores, disk and page cache: 3 nodes are not 3 times one
here. The README's model scales the per-node rate to a real cluster.
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tasks.checkpoint.state import VerifyOptions
from tasks.checkpoint.verify import verify_checkpoint
from tasks.profile import SlurmVerify
from tasks.storage.digest import Hashing
from tests.bench.bench_verify import LARGE, LARGE_MODEL, checkpoint, data_files

REPEATS = 3
SEGMENT = 256 << 20  # 2.6 GB in two files: 256 MiB segments give shards within 10% of each other
console = Console(highlight=False)


def timed(action) -> tuple[float, object]:
    samples, last = [], None
    for _ in range(REPEATS):
        start = time.perf_counter()
        last = action()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), last


def drop_cache(files: list[str]) -> None:
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cat(files: list[str], cold: bool):
    def read():
        if cold:
            drop_cache(files)
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True, timeout=600)

    return read


def verify(directory: Path, engine: str, nodes: int = 1, cold: bool = False):
    settings = SlurmVerify(
        nodes=nodes, partition="debug", time_limit="00:20:00", drop_cache=cold, straggler_min_seconds=600
    )
    options = VerifyOptions(
        job="bench", hashing=Hashing(segment_bytes=SEGMENT), engine=engine, slurm=settings
    )

    def run():
        result = verify_checkpoint(directory, options)
        if not result.ok:
            raise SystemExit(f"bench checkpoint failed verification ({engine}): {result.line()}")
        return result

    return run


def task_start() -> float:
    """What a shard task costs before it reads: Python and its imports (torch among them)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import tasks.checkpoint.shard_worker"], check=True, timeout=120)
    return time.perf_counter() - start


def main() -> int:
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit("bench_verify_slurm: SLURM_CONF is not set (make bench starts the local cluster)")
    directory = checkpoint(LARGE, 2, LARGE_MODEL)
    (directory / "manifest.json").unlink(missing_ok=True)
    files = data_files(directory)
    size = sum(os.path.getsize(f) for f in files)
    rows = []

    def row(name, seconds, note=""):
        rows.append((name, seconds, size / seconds / 1e9, note))

    with console.status("measuring the local and the Slurm engine..."):
        cat(files, cold=False)()
        row("cat > /dev/null, page cache warm", timed(cat(files, cold=False))[0])
        local, _ = timed(verify(directory, "local"))
        row("local engine (this host's threads)", local)
        per_node = {}
        for nodes in (1, 3):
            seconds, result = timed(verify(directory, "slurm", nodes))
            rates = [r["MB/s"] for r in result.shards]
            per_node[nodes] = statistics.median(rates)
            row(
                f"slurm engine, {nodes} node{'s' * (nodes > 1)}",
                seconds,
                f"{len(result.shards)} shards; per shard {min(rates):.0f}-{max(rates):.0f} MB/s",
            )
        one_node = rows[2][1]
        cold_cat, _ = timed(cat(files, cold=True))
        row("cat > /dev/null, cache dropped first", cold_cat)
        cold, result = timed(verify(directory, "slurm", 1, cold=True))
        cold_rate = result.shards[0]["MB/s"]
        row("slurm engine, 1 node, drop_cache (the default)", cold, f"{cold_rate:.0f} MB/s per node")
        start = statistics.median(task_start() for _ in range(REPEATS))

    table = Table(
        title=f"make bench: Slurm verify engine, {size / 1e9:.2f} GB ({len(files)} files), "
        f"{os.cpu_count()} cores shared by 3 nodes, median of {REPEATS}"
    )
    for column in ("step", "seconds", "GB/s", "note"):
        table.add_column(column, justify="left" if column in ("step", "note") else "right")
    for name, seconds, rate, note in rows:
        table.add_row(name, f"{seconds:.2f}", f"{rate:.2f}", note)
    console.print(table)
    overhead = one_node - local
    console.print(
        f"Slurm engine overhead (1 node minus local): {overhead:.2f} s (target < 2 s: "
        f"{'met' if overhead < 2 else 'NOT met'}); of it, a shard task's start (python + imports): "
        f"{start:.2f} s"
    )
    console.print(
        f"per-node verification rate, page cache warm: {per_node[1]:.0f} MB/s with the machine to itself, "
        f"{per_node[3]:.0f} MB/s per node with 3 sharing it; cache dropped: {cold_rate:.0f} MB/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
