"""Where a command's CPU goes, process by process: the kernel's own accounting of every process
that ends on the machine while the command runs (BSD process accounting, ``acct(2)``: user and system time,
start, elapsed, pid), named by command lines read from /proc while they run. The test suite's
warm start forks its processes from servers (tests/helpers/warm), so a forked process is named
by the process that stood for it: the one started at the same moment that ended with it.

    python -m tests.bench.cpu_by_process OUT -- make test     (as root: acct needs CAP_SYS_PACCT)

Prints the CPU seconds by command, the heaviest first, and leaves OUT/acct (the kernel's records)
and OUT/names.json. Sampling /proc misses names of processes that live under its 0.3 s period:
their CPU is reported under the kernel's 16-character command name.
"""

import argparse
import collections
import ctypes
import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

RECORD = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")  # struct acct_v3 (linux/acct.h)
TICKS = 100  # AHZ: the unit of acct_v3's times
WARM = "tests.helpers.warm.server"
# Set for the measured command: acct(2) is one setting for the whole machine, so a test of this
# tool inside a measured suite would take the suite's accounting over, then turn it off.
MEASURING = "CKPTOPS_CPU_ACCOUNTING"


def _comp(value: int) -> float:
    """A comp_t (13-bit mantissa, 3-bit base-8 exponent) in seconds."""
    return ((value & 0x1FFF) << (3 * (value >> 13))) / TICKS


def records(path: Path) -> list[dict]:
    """The kernel's records: pid, start and end (s), CPU (s), command name."""
    data = path.read_bytes()
    found = []
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        fields = RECORD.unpack_from(data, offset)
        pid, start, elapsed = fields[6], fields[8], fields[9] / TICKS
        cpu = _comp(fields[10]) + _comp(fields[11])
        comm = fields[18].split(b"\0")[0].decode(errors="replace")
        found.append({"pid": pid, "start": start, "end": start + elapsed, "cpu": cpu, "comm": comm})
    return found


def _sample(names: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if pid.isdigit():  # read again: a child forked but not yet exec'd has its parent's
                try:
                    line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
                except OSError:
                    continue
                if line:
                    names[pid] = line.decode(errors="replace")[:300]
        stop.wait(0.3)


def run(out: Path, command: list[str], timeout: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    acct = out / "acct"
    acct.write_bytes(b"")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(str(acct).encode()) != 0:
        raise SystemExit(f"{acct}: acct(2) refused: {os.strerror(ctypes.get_errno())} (run as root)")
    names: dict[str, str] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(names, stop), daemon=True)
    sampler.start()
    try:
        code = subprocess.run(command, timeout=timeout, env={**os.environ, MEASURING: "1"}).returncode
    finally:
        stop.set()
        sampler.join()
        libc.acct(None)
        (out / "names.json").write_text(json.dumps(names))
    return code


def label(line: str) -> str:
    """A command line without folders and most arguments: a Python's module or script and the
    word after it (``-c`` for inline code), another program's name and first word."""
    line = re.sub(r"/tmp/\S+", "<tmp>", line)
    words = [os.path.basename(w) if "/" in w else w for w in line.split()]
    if not words or not words[0].startswith("python"):
        return " ".join(words[:2])
    rest = words[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        rest = rest[1:]
    if rest[:1] == ["-m"]:
        return " ".join(rest[1:3])
    return "python -c" if rest[:1] == ["-c"] else " ".join(rest[:2])


def by_command(found: list[dict], names: dict[str, str]) -> collections.Counter:
    """CPU seconds by command; a warm fork counted under the process that stood for it."""
    forks = [r for r in found if WARM in names.get(str(r["pid"]), "")]
    others = [r for r in found if WARM not in names.get(str(r["pid"]), "")]
    stand_ins = [r for r in others if "python" in names.get(str(r["pid"]), "").split(" ")[0]]
    taken: set[int] = set()
    totals: collections.Counter = collections.Counter()
    for fork in sorted(forks, key=lambda r: -r["cpu"]):
        near = [
            s
            for s in stand_ins
            if s["pid"] not in taken
            and abs(s["start"] - fork["start"]) <= 2
            and abs(s["end"] - fork["end"]) <= 1.5
        ]
        if near:
            best = min(near, key=lambda s: abs(s["end"] - fork["end"]))
            taken.add(best["pid"])
            totals[label(names[str(best["pid"])])] += fork["cpu"]
        else:
            totals["(warm, unnamed) " + names[str(fork["pid"])].split()[3]] += fork["cpu"]
    for r in others:
        line = names.get(str(r["pid"]))
        totals[label(line) if line else f"[{r['comm']}]"] += r["cpu"]
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where the records go")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=7200, help="seconds the command may run")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    started = time.monotonic()
    code = run(args.out, command, args.timeout)
    totals = by_command(records(args.out / "acct"), json.loads((args.out / "names.json").read_text()))
    print(f"{sum(totals.values()):.1f} CPU-s in {time.monotonic() - started:.1f} s; exit {code}")
    for name, cpu in totals.most_common(args.top):
        print(f"{cpu:8.1f}  {name}")
    return code


if __name__ == "__main__":
    sys.exit(main())
