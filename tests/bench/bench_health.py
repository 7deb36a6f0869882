"""``make bench`` (third part): node health on 64 stand-in nodes against the wall time of one.

One real OpenSSH server listens on 127.0.0.2-127.0.0.65; its GPU tools are stand-ins replaying
recorded outputs, taking the time the profile gives the slow ones (diag and NCCL: 10 s each, as a
short real r1 and a one-size NCCL sweep would). Target: 64 nodes within 2x the wall time of one.
"""

import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tasks.health.run import run_health
from tasks.outcome import Verdict
from tasks.profile import load_profile
from tests.conftest import free_port
from tests.helpers.cluster import FakeCluster, profile_yaml

NODES = [f"127.0.0.{i}" for i in range(2, 66)]
SLOW_SECONDS = 10.0
console = Console(highlight=False)


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="ckptops-bench-health-"))
    cluster = FakeCluster(root / "cluster", NODES, free_port()).start()
    try:
        for key in ("diag", "nccl"):
            folder = cluster.root / "scenarios" / "default"
            (folder / f"{key}.sleep").write_text(str(SLOW_SECONDS))
        known_hosts = cluster.known_hosts(root / "known_hosts")
        path = root / "health.yaml"
        path.write_text(
            profile_yaml(
                cluster,
                NODES,
                known_hosts,
                root / "raw",
                concurrency=64,
                diag_timeout_seconds={1: 60},
                nccl={"timeout_seconds": 60},
            )
        )
        settings = load_profile(path).health
        rows = []
        for label, nodes in (("1 node", NODES[:1]), ("64 nodes", NODES)):
            with console.status(f"checking {label}..."):
                started = time.monotonic()
                run = run_health(settings, nodes)
                seconds = time.monotonic() - started
            passed = sum(r.verdict is Verdict.PASS for r in run.reports)
            rows.append((label, len(nodes), seconds, passed))
    finally:
        cluster.stop()
    table = Table(
        title="make bench: node health over SSH "
        f"(7 checks a node; diag and NCCL take {SLOW_SECONDS:g} s each)"
    )
    for column in ("run", "nodes", "wall s", "PASS"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for label, count, seconds, passed in rows:
        table.add_row(label, str(count), f"{seconds:.2f}", str(passed))
    console.print(table)
    ratio = rows[1][2] / rows[0][2]
    console.print(f"64 nodes / 1 node = {ratio:.2f} (target <= 2): {'met' if ratio <= 2 else 'NOT met'}")
    return 0 if rows[1][3] == len(NODES) else 1


if __name__ == "__main__":
    sys.exit(main())
