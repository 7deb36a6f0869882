"""nccl-tests ``all_reduce_perf`` output into a verdict against a bus-bandwidth gate.

- Data rows: ``size count type redop root`` then ``time algbw busbw #wrong`` out of place and in
  place (13 columns); builds up to v2.11 print 12 (a numeric error column instead of ``#wrong``);
  ``-c 0`` prints ``N/A`` for ``#wrong``. Header lines start with ``#``; MPI noise may come first.
- The footer (``# Out of bounds values``, ``# Avg bus bandwidth``) means the run finished; the
  average is over all sizes and is never gated on. The gate is the largest out-of-place busbw at
  sizes of at least 1 GiB.
- ``Test NCCL failure`` / ``Test CUDA failure`` lines and exit codes 1-4 mean the test could
  not run: a tool or environment error, not a verdict on the node. ``NCCL WARN`` lines mean the
  same only when the table did not finish; after a complete table they are kept as evidence. Exit 7, a
  ``#wrong`` above 0 or ``FAILED`` out-of-bounds values mean wrong results: hardware.
- A build without MPI launched by mpirun runs one rank per process: busbw 0.00 with ``nranks 1``,
  a setup error (FAIL_CONFIG), not a slow node.
"""

import math
import re
from dataclasses import dataclass, field

from tasks.health.verdict import Evidence, HealthCheck, result
from tasks.outcome import Verdict

GIB = 1 << 30
_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+\w+\s+\w+\s+-?\d+\s+")
_FAILURE = re.compile(r"(Test (?:NCCL|CUDA) failure.*|Test failure.*)")
_WARN = re.compile(r"(NCCL WARN.*)")


@dataclass(frozen=True)
class Gate:
    """A bus-bandwidth gate: pass at or above ``pass_gbps``, warn at or above ``warn_gbps``."""

    name: str
    pass_gbps: float
    warn_gbps: float


@dataclass(frozen=True)
class Gates:
    """One node's NVLink fabric and several nodes' network are gated apart: a healthy 2-node
    all-reduce over InfiniBand runs far below what one node's NVLink does."""

    one_node: Gate
    several_nodes: Gate

    @classmethod
    def from_settings(cls, nccl, pairs) -> "Gates":
        """The profile's ``health.nccl`` and ``health.pairs`` sections."""
        return cls(
            Gate("the one-node gate health.nccl", nccl.pass_gbps, nccl.warn_gbps),
            Gate("the several-nodes gate health.pairs", pairs.pass_gbps, pairs.warn_gbps),
        )


@dataclass
class Row:
    size: int
    busbw_out: float
    wrong_out: int | None  # None: not validated (-c 0)
    wrong_in: int | None


@dataclass
class AllReduceRun:
    rows: list[Row] = field(default_factory=list)
    header: bool = False
    rank_ids: set[int] = field(default_factory=set)
    hosts: set[str] = field(default_factory=set)  # from the rank table: how many nodes took part
    out_of_bounds: tuple[int, bool] | None = None  # (count, ok)
    average_busbw: float | None = None
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # data rows whose numbers do not parse


_RANK = re.compile(r"#\s+Rank\s+(\d+)\b.*?\bon\s+(\S+)\s+device")


def parse_allreduce(text: str) -> AllReduceRun:
    run = AllReduceRun()
    for line in text.splitlines():
        stripped = line.strip()
        failure = _FAILURE.search(stripped)
        if failure:
            run.failures.append(failure.group(1).strip())
            continue
        warning = _WARN.search(stripped)
        if warning:
            run.warnings.append(warning.group(1).strip())
            continue
        if stripped.startswith("#"):
            _header_line(run, stripped)
            continue
        if run.header and _ROW.match(line):
            tokens = stripped.split()
            if len(tokens) >= 12:
                # 13 columns: size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong
                # 12 columns (<= v2.11): ... | time algbw busbw error | time algbw busbw error
                try:
                    run.rows.append(
                        Row(int(tokens[0]), float(tokens[7]), _wrong(tokens[8]), _wrong(tokens[-1]))
                    )
                except ValueError:
                    run.malformed.append(stripped[:120])
    return run


def _header_line(run: AllReduceRun, stripped: str) -> None:
    if re.match(r"#\s+size\s+count", stripped):
        run.header = True
    elif rank := re.match(r"#\s+Rank\s+(\d+)", stripped):
        # Distinct ranks: a non-MPI build under mpirun prints "Rank 0" once per process.
        run.rank_ids.add(int(rank[1]))
        host = _RANK.match(stripped)
        if host:
            run.hosts.add(host[2])
    elif "Out of bounds values" in stripped:
        match = re.search(r":\s*(\d+)\s+(OK|FAILED)", stripped)
        if match:
            run.out_of_bounds = (int(match[1]), match[2] == "OK")
    elif "Avg bus bandwidth" in stripped:
        match = re.search(r":\s*([\d.]+)", stripped)
        run.average_busbw = float(match[1]) if match else None


def _wrong(token: str) -> int | None:
    """A ``#wrong`` (or old ``error``) cell: None for ``N/A`` (-c 0), else how many were wrong;
    a value that is not a finite number raises ValueError (the row is then not trusted)."""
    if token == "N/A":
        return None
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(token)
    # Old builds print a floating-point error column: any error above zero means wrong values.
    return int(value > 0) if "." in token or "e" in token else int(value)


def _gate_for(run: AllReduceRun, gates: Gates) -> tuple[Gate, str]:
    hosts = sorted(run.hosts)
    if len(hosts) > 1:
        return (
            gates.several_nodes,
            f"{len(hosts)} nodes ({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''})",
        )
    if hosts:
        return gates.one_node, f"1 node ({hosts[0]})"
    return gates.one_node, "no rank table to count nodes by"


def classify_allreduce(text: str, exit_code: int | None, gates: Gates, check: str = "nccl") -> HealthCheck:
    """Verdict for one all_reduce_perf run: the largest out-of-place busbw at >= 1 GiB against the
    gate for the number of nodes its rank table names."""
    run = parse_allreduce(text)

    def verdict(kind: Verdict, detail: str, **evidence) -> HealthCheck:
        return result(check, kind, Evidence(detail, test=check, **evidence), exit_code=exit_code)

    wrong = [r for r in run.rows if (r.wrong_out or 0) > 0 or (r.wrong_in or 0) > 0]
    if exit_code == 7 or wrong or (run.out_of_bounds and not run.out_of_bounds[1]):
        first = wrong[0].size if wrong else None
        detail = f"wrong results at size {first}" if first else f"out-of-bounds values: {run.out_of_bounds}"
        return verdict(Verdict.FAIL_HARDWARE, f"{detail} (data corruption: hardware)")
    if run.failures or (run.warnings and run.out_of_bounds is None):
        # A finished table is judged on its numbers, whatever NCCL warned about on the way; a run
        # that failed, or warned and never finished, could not test the node.
        return verdict(
            Verdict.TOOL_ERROR, f"the test could not run: {(run.failures or run.warnings)[0][:200]}"
        )
    if exit_code not in (0, None):
        return verdict(Verdict.TOOL_ERROR, f"all_reduce_perf exited {exit_code}")
    if run.malformed:
        return verdict(Verdict.TOOL_ERROR, f"a data row whose numbers do not parse: {run.malformed[0]!r}")
    if not run.header:
        return verdict(Verdict.TOOL_ERROR, "no result table in the output")
    if not run.rows:
        return verdict(Verdict.TOOL_ERROR, "output cut after the header: no data rows")
    if run.out_of_bounds is None:
        return verdict(Verdict.TOOL_ERROR, f"no footer after {len(run.rows)} rows: the run did not finish")
    odd = next((r for r in run.rows if not math.isfinite(r.busbw_out)), None)
    if odd is not None:
        return verdict(
            Verdict.TOOL_ERROR, f"busbw {odd.busbw_out} at size {odd.size}: not a number a gate can judge"
        )
    if len(run.rank_ids) <= 1 and max(r.busbw_out for r in run.rows) == 0.0:
        return verdict(
            Verdict.FAIL_CONFIG,
            "nranks 1 and busbw 0.00: a build without MPI launched by mpirun (setup error)",
        )
    large = [r for r in run.rows if r.size >= GIB]
    if not large:
        return verdict(Verdict.TOOL_ERROR, "no message size of at least 1 GiB to gate on (run with -e 8G)")
    gate, nodes = _gate_for(run, gates)
    peak = max(r.busbw_out for r in large)
    unvalidated = any(r.wrong_out is None for r in run.rows)
    if peak >= gate.pass_gbps:
        kind = Verdict.WARN if unvalidated else Verdict.PASS
    elif peak >= gate.warn_gbps:
        kind = Verdict.WARN
    else:
        kind = Verdict.FAIL_HARDWARE
    detail = (
        f"peak out-of-place busbw {peak:.2f} GB/s at >= 1 GiB (pass >= {gate.pass_gbps:g}, "
        f"warn >= {gate.warn_gbps:g}; {nodes}: {gate.name})"
    )
    if unvalidated:
        detail += "; results not validated (-c 0)"
    if run.warnings:
        detail += f"; NCCL warned: {run.warnings[0][:120]}"
    return verdict(kind, detail, value=peak, gate=gate.pass_gbps)
