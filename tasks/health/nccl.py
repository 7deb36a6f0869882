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

import re
from dataclasses import dataclass, field

from tasks.health.verdict import CheckResult, Evidence, Verdict, result

GIB = 1 << 30
_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+\w+\s+\w+\s+-?\d+\s+")
_FAILURE = re.compile(r"(Test (?:NCCL|CUDA) failure.*|Test failure.*)")
_WARN = re.compile(r"(NCCL WARN.*)")


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
    out_of_bounds: tuple[int, bool] | None = None  # (count, ok)
    average_busbw: float | None = None
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _number(token: str) -> int | None:
    return None if token == "N/A" else int(float(token))


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
            if re.match(r"#\s+size\s+count", stripped):
                run.header = True
            elif rank := re.match(r"#\s+Rank\s+(\d+)", stripped):
                # Distinct ranks: a non-MPI build under mpirun prints "Rank 0" once per process.
                run.rank_ids.add(int(rank[1]))
            elif "Out of bounds values" in stripped:
                match = re.search(r":\s*(\d+)\s+(OK|FAILED)", stripped)
                if match:
                    run.out_of_bounds = (int(match[1]), match[2] == "OK")
            elif "Avg bus bandwidth" in stripped:
                match = re.search(r":\s*([\d.]+)", stripped)
                run.average_busbw = float(match[1]) if match else None
            continue
        if run.header and _ROW.match(line):
            tokens = stripped.split()
            if len(tokens) >= 12:
                # 13 columns: size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong
                # 12 columns (<= v2.11): ... | time algbw busbw error | time algbw busbw error
                run.rows.append(Row(int(tokens[0]), float(tokens[7]), _wrong(tokens[8]), _wrong(tokens[-1])))
    return run


def _wrong(token: str) -> int | None:
    if token == "N/A":
        return None
    value = float(token)
    # Old builds print a floating-point error column: any error above zero means wrong values.
    return int(value > 0) if "." in token or "e" in token else int(value)


def classify_allreduce(
    text: str, exit_code: int | None, pass_gbps: float, warn_gbps: float, check: str = "nccl"
) -> CheckResult:
    """Verdict for one all_reduce_perf run against the gate (pass >= pass_gbps, warn >= warn_gbps)."""
    run = parse_allreduce(text)
    wrong = [r for r in run.rows if (r.wrong_out or 0) > 0 or (r.wrong_in or 0) > 0]
    if exit_code == 7 or wrong or (run.out_of_bounds and not run.out_of_bounds[1]):
        first = wrong[0].size if wrong else None
        detail = f"wrong results at size {first}" if first else f"out-of-bounds values: {run.out_of_bounds}"
        return result(
            check,
            Verdict.FAIL_HARDWARE,
            Evidence(f"{detail} (data corruption: hardware)", test=check),
            exit_code=exit_code,
        )
    if run.failures or (run.warnings and run.out_of_bounds is None):
        # A finished table is judged on its numbers, whatever NCCL warned about on the way; a run
        # that failed, or warned and never finished, could not test the node.
        first = (run.failures or run.warnings)[0]
        return result(
            check,
            Verdict.TOOL_ERROR,
            Evidence(f"the test could not run: {first[:200]}", test=check),
            exit_code=exit_code,
        )
    if exit_code not in (0, None):
        return result(
            check,
            Verdict.TOOL_ERROR,
            Evidence(f"all_reduce_perf exited {exit_code}", test=check),
            exit_code=exit_code,
        )
    if not run.header:
        return result(
            check,
            Verdict.TOOL_ERROR,
            Evidence("no result table in the output", test=check),
            exit_code=exit_code,
        )
    if not run.rows:
        return result(
            check,
            Verdict.TOOL_ERROR,
            Evidence("output cut after the header: no data rows", test=check),
            exit_code=exit_code,
        )
    if run.out_of_bounds is None:
        return result(
            check,
            Verdict.TOOL_ERROR,
            Evidence(f"no footer after {len(run.rows)} rows: the run did not finish", test=check),
            exit_code=exit_code,
        )
    if len(run.rank_ids) <= 1 and max(r.busbw_out for r in run.rows) == 0.0:
        return result(
            check,
            Verdict.FAIL_CONFIG,
            Evidence(
                "nranks 1 and busbw 0.00: a build without MPI launched by mpirun (setup error)", test=check
            ),
            exit_code=exit_code,
        )
    large = [r for r in run.rows if r.size >= GIB]
    if not large:
        return result(
            check,
            Verdict.TOOL_ERROR,
            Evidence("no message size of at least 1 GiB to gate on (run with -e 8G)", test=check),
            exit_code=exit_code,
        )
    peak = max(r.busbw_out for r in large)
    gate = (
        f"peak out-of-place busbw {peak:.2f} GB/s at >= 1 GiB (pass >= {pass_gbps:g}, warn >= {warn_gbps:g})"
    )
    unvalidated = any(r.wrong_out is None for r in run.rows)
    if peak >= pass_gbps:
        verdict = Verdict.WARN if unvalidated else Verdict.PASS
    elif peak >= warn_gbps:
        verdict = Verdict.WARN
    else:
        verdict = Verdict.FAIL_HARDWARE
    note = "; results not validated (-c 0)" if unvalidated else ""
    if run.warnings:
        note += f"; NCCL warned: {run.warnings[0][:120]}"
    return result(
        check, verdict, Evidence(gate + note, test=check, value=peak, gate=pass_gbps), exit_code=exit_code
    )
