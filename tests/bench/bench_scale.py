"""``make bench``, the seed's scale: verifying checkpoints with the file and record count of a
TP8 x PP8 x DP80 job with the distributed optimizer (5,120 data files; 100k and 1M chunk records
in ``.metadata``), beside a plain read of the same files and a bare ``pickle.load`` of the same
``.metadata``, measured in the same run.

The checkpoints are written by megatron-core's and torch's own save code, driven per simulated
rank (``tests.bench.seed_scale``), with small tensors: the bytes are a few GB, the per-file and
per-record work is the seed's. They are generated once and kept in data/bench/. Each figure is
taken in a new process, page cache warm, peak RSS included; imports excluded from the time (torch,
and megatron-core's allowlist for the common state's args: about 3 s, once per process).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tests.bench.seed_scale import make

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "data" / "bench"
CASES = (("seed-100k", 100_000), ("seed-1m", 1_000_000))
console = Console(highlight=False, width=160)

_VERIFY = """
import json, resource, sys, time
from pathlib import Path
import torch  # imported before the clock starts: a verifier's start is not its work
import megatron.core.safe_globals  # nor the allowlist a Megatron-LM job's args need (~3 s, once)
from tasks.checkpoint.state import VerifyOptions
from tasks.checkpoint.verify import verify_checkpoint
start = time.perf_counter()
result = verify_checkpoint(Path(sys.argv[1]), VerifyOptions(job="bench"))
seconds = time.perf_counter() - start
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "ok": result.ok, "line": result.line(), "rss": rss}))
"""

_PARSE = """
import gc, json, pickle, sys, time
import torch.distributed.checkpoint.metadata  # the classes the pickle names
if sys.argv[2] == "off":
    gc.disable()
start = time.perf_counter()
with open(sys.argv[1], "rb") as f:
    metadata = pickle.load(f)
print(json.dumps({"seconds": time.perf_counter() - start, "records": len(metadata.storage_data)}))
"""


def _child(code: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=1800, cwd=ROOT
    )
    if done.returncode != 0:
        raise SystemExit(f"bench child failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _plain_read(files: list[Path]) -> float:
    start = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return time.perf_counter() - start


def measure(name: str, records: int) -> dict:
    with console.status(f"{name}: generating (once; kept in data/bench)..."):
        directory = make(BENCH / name, records=records)
    files = sorted(p for p in directory.iterdir() if p.name.endswith(".distcp"))
    (directory / "manifest.json").unlink(missing_ok=True)
    _plain_read(files)  # warm the page cache
    with console.status(f"{name}: measuring..."):
        plain = _plain_read(files)
        parse = _child(_PARSE, str(directory / ".metadata"), "on")
        parse_off = _child(_PARSE, str(directory / ".metadata"), "off")
        verified = _child(_VERIFY, str(directory))
    if not verified["ok"]:
        raise SystemExit(f"{name}: the bench checkpoint failed verification: {verified['line']}")
    return {
        "case": name,
        "files": len(files),
        "records": parse["records"],
        "bytes": sum(p.stat().st_size for p in files) + (directory / ".metadata").stat().st_size,
        "plain_read_seconds": plain,
        "bare_parse_seconds": parse["seconds"],
        "bare_parse_gc_off_seconds": parse_off["seconds"],
        "verify_seconds": verified["seconds"],
        "verify_peak_rss_bytes": verified["rss"],
    }


def listing(directory: Path, repeats: int = 5) -> float:
    """The reference for promotion: one listing of the directory with one ``lstat`` per entry
    (what promotion must still do for its re-save and permission checks), median seconds."""
    import statistics

    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        with os.scandir(directory) as entries:
            for entry in entries:
                entry.stat(follow_symlinks=False)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def promotion(directory: Path, repeats: int = 5) -> float:
    """Promoting the verified checkpoint (``apply_promotion`` under the job lock: the catalog,
    who may write what it trusts, the pointer's last check and write), median seconds, as a new
    process pays it: the pointer cleared and no manifest parsed yet before each."""
    import statistics

    from tasks.checkpoint import manifest
    from tasks.checkpoint.lock import job_lock
    from tasks.checkpoint.pointer import clear_pointer
    from tasks.checkpoint.promote import apply_promotion
    from tasks.checkpoint.state import VerifyOptions
    from tasks.checkpoint.verify import verify_and_record

    options = VerifyOptions(job="bench")
    with job_lock(directory.parent, 10) as held:
        verify_and_record(directory, options, held)
    samples = []
    for _ in range(repeats):
        clear_pointer(directory.parent)
        manifest._PARSED.clear()
        start = time.perf_counter()
        with job_lock(directory.parent, 10):
            report = apply_promotion(directory.parent, options)
        samples.append(time.perf_counter() - start)
        assert report.current == int(directory.name[5:]), report
    (directory / "manifest.json").unlink()
    return statistics.median(samples)


def main() -> int:
    rows = [measure(name, records) for name, records in CASES]
    with console.status("promotion of the verified 5,120-file save..."):
        directory = make(BENCH / CASES[0][0], records=CASES[0][1])
        promoted, listed = promotion(directory), listing(directory)
    table = Table(
        title=f"make bench: the seed's scale, page cache warm, {os.cpu_count()} cores, one run each"
    )
    for column in (
        "case",
        "files",
        "records",
        "GB",
        "plain read s",
        "pickle.load s (gc off)",
        "ckptops verify s",
        "x (read + load)",
        "us / record",
        "peak RSS GB",
    ):
        table.add_column(column, justify="left" if column == "case" else "right")
    for r in rows:
        reference = r["plain_read_seconds"] + r["bare_parse_seconds"]
        table.add_row(
            r["case"],
            str(r["files"]),
            f"{r['records']:,}",
            f"{r['bytes'] / 1e9:.2f}",
            f"{r['plain_read_seconds']:.2f}",
            f"{r['bare_parse_seconds']:.2f} ({r['bare_parse_gc_off_seconds']:.2f})",
            f"{r['verify_seconds']:.2f}",
            f"{r['verify_seconds'] / reference:.2f}",
            f"{(r['verify_seconds'] - r['plain_read_seconds']) / r['records'] * 1e6:.1f}",
            f"{r['verify_peak_rss_bytes'] / 1e9:.2f}",
        )
    console.print(table)
    small, large = rows
    ratio = small["verify_seconds"] / (small["plain_read_seconds"] + small["bare_parse_seconds"])
    console.print(
        f"{small['case']}: verify / (plain read + pickle.load) = {ratio:.2f} (target <= 3): "
        f"{'met' if ratio <= 3 else 'NOT met'}; {large['case']}: {large['verify_seconds']:.1f} s "
        f"(target <= 60 s): {'met' if large['verify_seconds'] <= 60 else 'NOT met'}"
    )
    console.print(
        f"promotion of the verified {small['files']}-file save: {promoted * 1e3:.1f} ms "
        f"(target <= 50 ms): {'met' if promoted <= 0.05 else 'NOT met'}; one listing of its "
        f"directory with a stat per entry, the floor it keeps: {listed * 1e3:.1f} ms"
    )
    (BENCH / "scale-results.json").write_text(
        json.dumps(rows + [{"promotion_seconds": promoted, "listing_seconds": listed}], indent=2) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
