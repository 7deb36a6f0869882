"""Software and settings a node must share with the fleet: driver, CUDA, NCCL and kernel
versions, the GPUs' application clocks and power limit, the NICs' firmware and link rate. A
replaced node that differs in one of them slows the whole pipeline without failing any other
check, so these facts are read (bounded commands, one per tool) and compared: GPUs within the
node with each other, the node with the profile's pins (``health.conformance.pins``), and, once
every node is checked, with the fleet's majority (tasks.health.fleet). A difference is
FAIL_CONFIG: a setting or an install to fix, not hardware.

A fact whose tool is not on the node is not read and not compared, unless it is pinned: then
the check cannot pass (TOOL_ERROR naming the tool). An output that is not what the tool says
is a TOOL_ERROR, never a pass. The facts read are kept in ``ctx.facts`` (and in the node's
history), so that later comparisons (a spare's admission, a resume's validation) need not
check the whole fleet again."""

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from tasks.health.checks import Context, failed_to_run
from tasks.health.verdict import CheckName, Evidence, HealthCheck, result
from tasks.outcome import Verdict

NAME = CheckName.CONFORMANCE

# The facts, in the order reports name them: what health.conformance.pins may pin.
Fact = Literal[
    "driver",
    "cuda",
    "nccl",
    "kernel",
    "gpu_clock_mhz",
    "memory_clock_mhz",
    "power_limit_w",
    "nic_firmware",
    "nic_rate_gbps",
]
FACTS = get_args(Fact)
# nvidia-smi --query-gpu columns (without their unit) -> the fact each one gives.
COLUMNS = {
    "driver_version": "driver",
    "clocks.applications.graphics": "gpu_clock_mhz",
    "clocks.applications.memory": "memory_clock_mhz",
    "power.limit": "power_limit_w",
}
GPU_QUERY = [
    "nvidia-smi",
    "--query-gpu=index,driver_version,clocks.applications.graphics,clocks.applications.memory,power.limit",
    "--format=csv",
]
NOT_A_VALUE = {"", "N/A", "Not Supported"}  # and anything nvidia-smi puts in brackets: [N/A], [Not Supported]


def number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def same(value: str, expected: str | float) -> bool:
    """Numbers compare as numbers (``700`` is ``700.00``), anything else as exact text."""
    a, b = number(str(value)), number(str(expected))
    return a == b if a is not None and b is not None else str(value) == str(expected)


def canonical(value: str | float) -> str:
    """One spelling per value, so that equal numbers count as one in a majority."""
    n = number(str(value))
    return f"{n:g}" if n is not None else str(value)


def _cell(column: str, text: str) -> str | None:
    if text in NOT_A_VALUE or (text.startswith("[") and text.endswith("]")):
        return None
    if column == "driver_version":
        return text
    n = number(text.split()[0])
    if n is None:
        raise ValueError(f"{column}: {text!r} is not a number")
    return f"{n:g}"


def gpu_rows(text: str) -> list[dict[str, str | None]]:
    """The rows of an ``nvidia-smi --query-gpu ... --format=csv`` output, by column (without
    the unit in brackets): index and the columns in ``COLUMNS``, ``None`` where the GPU says
    N/A. Columns are found by name, so a query with more columns reads the same. ValueError
    for an output that is not such a query's."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError("no output")
    header = [re.sub(r"\s*\[.*\]$", "", c.strip()) for c in lines[0].split(",")]
    if "index" not in header or not set(COLUMNS) & set(header):
        raise ValueError(f"not a --query-gpu output: {lines[0][:80]}")
    if len(lines) == 1:
        raise ValueError("a header and no GPU")
    rows = []
    for line in lines[1:]:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(header) or not cells[header.index("index")].isdigit():
            raise ValueError(f"not a --query-gpu row: {line[:80]}")
        row = {"index": cells[header.index("index")]}
        for column in COLUMNS:
            if column in header:
                row[column] = _cell(column, cells[header.index(column)])
        rows.append(row)
    return rows


def _gpus(indices: list[str]) -> str:
    return f"GPU{'s' if len(indices) > 1 else ''} {','.join(indices)}"


def gpu_facts(rows: list[dict[str, str | None]]) -> tuple[dict[str, str], list[Evidence]]:
    """The node's GPU facts, and a finding for each that differs between its GPUs (one GPU at
    lower clocks or a lower power limit slows every collective it is part of)."""
    facts, findings = {}, []
    for column, fact in COLUMNS.items():
        by_value: dict[str, list[str]] = {}
        for row in rows:
            if row.get(column) is not None:
                by_value.setdefault(row[column], []).append(row["index"])
        if not by_value:
            continue
        ranked = sorted(by_value.items(), key=lambda item: -len(item[1]))
        facts[fact] = ranked[0][0] if len(ranked) == 1 else "; ".join(f"{v} on {_gpus(g)}" for v, g in ranked)
        if len(ranked) > 1:
            findings.append(Evidence(f"{fact} differs between the node's GPUs: {facts[fact]}"))
    return facts, findings


def cuda_version(text: str) -> str:
    """The CUDA version the driver supports, from nvidia-smi's banner (or ``nvidia-smi -q``)."""
    found = re.search(r"CUDA Version\s*:\s*([0-9]+(?:\.[0-9]+)*)", text)
    if found is None:
        raise ValueError("no CUDA Version in its output")
    return found.group(1)


def kernel_release(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) != 1 or len(lines[0].split()) != 1:
        raise ValueError(f"not a kernel release: {text.strip()[:80]!r}")
    return lines[0]


@dataclass
class Adapter:
    name: str
    type: str = ""
    firmware: str = ""
    active_rates: tuple[int, ...] = ()


def adapters(text: str) -> list[Adapter]:
    """``ibstat``'s channel adapters: type, firmware, and the rates (Gb/s) of their active
    ports. ValueError for an output without one, or an adapter without its firmware."""
    found: list[Adapter] = []
    state = None
    for raw in text.splitlines():
        line = raw.strip()
        if match := re.fullmatch(r"CA '([^']+)'", line):
            found.append(Adapter(match.group(1)))
            state = None
            continue
        key, colon, value = line.partition(":")
        value = value.strip()
        if not found or not colon:
            continue
        adapter = found[-1]
        if key == "CA type":
            adapter.type = value
        elif key == "Firmware version":
            adapter.firmware = value
        elif key == "State":
            state = value
        elif key == "Rate" and state == "Active":
            rate = number(value.split()[0]) if value else None
            if rate is None:
                raise ValueError(f"{adapter.name}: rate {value!r} is not a number")
            adapter.active_rates += (int(rate),)
    if not found:
        raise ValueError("no channel adapter (CA '...') in its output")
    for adapter in found:
        if not adapter.firmware:
            raise ValueError(f"{adapter.name}: no Firmware version")
    return found


def nic_facts(found: list[Adapter]) -> tuple[dict[str, str], list[Evidence]]:
    """Firmware per adapter type (``MT4129 28.41.1000``; a node may hold compute and storage
    NICs of different types), and the active ports' rates with their counts (``400 x8``). Two
    adapters of one type on different firmware are a finding."""
    by_type: dict[str, dict[str, list[str]]] = {}
    for adapter in found:
        by_type.setdefault(adapter.type or "?", {}).setdefault(adapter.firmware, []).append(adapter.name)
    parts, findings = [], []
    for kind in sorted(by_type):
        versions = by_type[kind]
        parts.append(f"{kind} {'/'.join(sorted(versions))}")
        if len(versions) > 1:
            named = "; ".join(f"{v} on {', '.join(names)}" for v, names in sorted(versions.items()))
            findings.append(Evidence(f"nic_firmware differs between the node's {kind} adapters: {named}"))
    rates = Counter(rate for adapter in found for rate in adapter.active_rates)
    rate_text = ", ".join(f"{rate} x{n}" for rate, n in sorted(rates.items(), reverse=True)) or "none active"
    return {"nic_firmware": ", ".join(parts), "nic_rate_gbps": rate_text}, findings


def nccl_version(text: str) -> str:
    """What the profile's NCCL command printed last: ``torch.cuda.nccl.version()``'s tuple
    ``(2, 21, 5)``, a dotted ``2.21.5``, or NCCL's version code (``22105``; ``2708`` before 2.9)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    parts = re.fullmatch(r"\(?\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\)?", last) or re.fullmatch(
        r"(\d+)\.(\d+)\.(\d+)", last
    )
    if parts:
        return ".".join(str(int(p)) for p in parts.groups())
    if last.isdigit():
        code = int(last)
        major, rest = (code // 10000, code % 10000) if code >= 20900 else (code // 1000, code % 1000)
        return f"{major}.{rest // 100}.{rest % 100}"
    raise ValueError(f"not an NCCL version: {last[:80]!r}")


@dataclass(frozen=True)
class Source:
    """One command, the facts it gives, and how its output is read."""

    argv: list[str]
    facts: tuple[str, ...]
    read: Callable[[str], tuple[dict[str, str], list[Evidence]]]

    @property
    def tool(self) -> str:
        return self.argv[0]


def _only(fact: str, parse: Callable[[str], str]) -> Callable[[str], tuple[dict[str, str], list[Evidence]]]:
    return lambda text: ({fact: parse(text)}, [])


def sources(settings) -> list[Source]:
    found = [
        Source(GPU_QUERY, tuple(COLUMNS.values()), lambda text: gpu_facts(gpu_rows(text))),
        Source(["nvidia-smi"], ("cuda",), _only("cuda", cuda_version)),
        Source(["uname", "-r"], ("kernel",), _only("kernel", kernel_release)),
        Source(["ibstat"], ("nic_firmware", "nic_rate_gbps"), lambda text: nic_facts(adapters(text))),
    ]
    if settings.conformance.nccl_command:
        found.append(Source(list(settings.conformance.nccl_command), ("nccl",), _only("nccl", nccl_version)))
    return found


def read_facts(ctx: Context) -> tuple[dict[str, str], list[Evidence], list[str], dict[str, str]]:
    """Every source's facts: (facts, findings within the node, errors, why each unread fact
    was not read)."""
    facts, findings, errors, unread = {}, [], [], {}
    for source in sources(ctx.settings):
        output = ctx.command(NAME, source.argv)
        if output.exit_code == 127 and not output.timed_out:
            unread.update({fact: f"{source.tool} is not on the node" for fact in source.facts})
            continue
        failed = failed_to_run(NAME, output)
        if failed:
            errors.append(failed.detail)
            continue
        try:
            got, found = source.read(output.stdout)
        except ValueError as e:
            errors.append(f"{' '.join(source.argv)[:60]}: {e}")
            continue
        facts.update(got)
        findings += found
        unread.update({f: f"{source.tool} gave no value" for f in source.facts if f not in got})
    if not ctx.settings.conformance.nccl_command:
        unread["nccl"] = "no health.conformance.nccl_command"
    return {fact: facts[fact] for fact in FACTS if fact in facts}, findings, errors, unread


def against_pins(
    facts: dict[str, str], pins: dict, unread: dict[str, str]
) -> tuple[list[Evidence], list[str]]:
    """A finding for each pinned fact the node differs in; an error for each it could not read."""
    findings, errors = [], []
    for fact in FACTS:
        if fact not in pins:
            continue
        if fact in facts:
            if not same(facts[fact], pins[fact]):
                findings.append(Evidence(f"{fact} {facts[fact]}, expected {canonical(pins[fact])} (pinned)"))
        else:
            errors.append(
                f"{fact} is pinned ({canonical(pins[fact])}) but not read: {unread.get(fact, 'no value')}"
            )
    return findings, errors


def summary(facts: dict[str, str], unread: dict[str, str]) -> str:
    read = ", ".join(f"{fact} {facts[fact]}" for fact in FACTS if fact in facts) or "no fact read"
    reasons: dict[str, list[str]] = {}
    for fact in FACTS:
        if fact not in facts and fact in unread:
            reasons.setdefault(unread[fact], []).append(fact)
    skipped = "; ".join(f"{', '.join(names)} not read ({why})" for why, names in reasons.items())
    return read + (f"; {skipped}" if skipped else "")


def run(ctx: Context) -> HealthCheck:
    facts, findings, errors, unread = read_facts(ctx)
    ctx.facts = facts
    pinned, pin_errors = against_pins(facts, ctx.settings.conformance.pins, unread)
    findings, errors = findings + pinned, errors + pin_errors
    if findings:
        evidence = findings + [Evidence(e) for e in errors]
        return result(NAME, Verdict.FAIL_CONFIG, *evidence, exit_code=0)
    if errors:
        return result(NAME, Verdict.TOOL_ERROR, *(Evidence(e) for e in errors))
    return result(NAME, Verdict.PASS, Evidence(summary(facts, unread)), exit_code=0)
