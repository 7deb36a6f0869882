"""The fan-out: every node checked in parallel (bounded), one connection per node, every command
bounded, tool errors retried once (then SUSPECT), raw outputs and a history kept per node.

Raw outputs: ``<raw_dir>/<node>/<time>-<check>-<n>.txt``; history: ``<raw_dir>/<node>/history.jsonl``
(tasks/health/history.py: one line per check run of the node, and one per incident that named it),
which also tells the XID check where to start reading.
"""

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from tasks.cluster import slurm
from tasks.cluster.transport import (
    HostKeyRejected,
    LocalHost,
    SshHost,
    SshSettings,
    Unreachable,
    check_node_name,
)
from tasks.errors import CkptopsError, Unreadable
from tasks.health import fleet
from tasks.health.checks import (
    Context,
    conformance,
    dcgm_diag,
    gpu_count,
    gpu_processes,
    nccl,
    nvlink,
    recovery,
    row_remap,
    xid,
)
from tasks.health.history import VERDICT, kind, read_history, record_facts, record_verdict, suspect_check
from tasks.health.nccl import Gates, classify_allreduce
from tasks.health.verdict import CheckName, Evidence, HealthCheck, result
from tasks.outcome import Verdict, worst

CHECKS = {
    m.NAME: m
    for m in (gpu_count, gpu_processes, recovery, row_remap, xid, nvlink, dcgm_diag, nccl, conformance)
}


@dataclass
class NodeReport:
    node: str
    verdict: Verdict
    checks: list[HealthCheck] = field(default_factory=list)
    started_at: str = ""
    seconds: float = 0.0
    facts: dict[str, str] = field(default_factory=dict)  # what the conformance check read

    @property
    def worst_check(self) -> HealthCheck | None:
        failing = [c for c in self.checks if c.verdict is not Verdict.PASS]
        return max(failing, key=lambda c: c.verdict.rank) if failing else None

    @property
    def summary(self) -> str:
        check = self.worst_check
        return f"{check.name}: {check.detail}" if check else "all checks passed"

    def to_dict(self) -> dict:
        return {
            "node": self.node,
            "verdict": self.verdict.value,
            "started_at": self.started_at,
            "seconds": round(self.seconds, 3),
            "checks": [c.to_dict() for c in self.checks],
        } | ({"facts": self.facts} if self.facts else {})


def resolve_nodes(settings, only: list[str] | None = None) -> list[str]:
    """The nodes to check: ``only`` if given, else the profile's list, partition or nodelist."""
    if only:
        return [check_node_name(n) for n in only]
    nodes = list(settings.nodes)
    if settings.slurm_nodelist:
        nodes += slurm.expand_nodelist(settings.slurm_nodelist)
    if settings.slurm_partition:
        nodes += slurm.partition_nodes(settings.slurm_partition)
    return [check_node_name(n) for n in dict.fromkeys(nodes)]


def ssh_key_text(settings) -> str | None:
    """The private key from a Prefect Secret block, if the profile names one (never logged)."""
    if settings.transport != "ssh" or not settings.ssh.secret_block:
        return None
    from prefect.blocks.system import Secret

    return Secret.load(settings.ssh.secret_block).get()


def _host(node: str, settings, key_text: str | None):
    if settings.transport == "local":
        return LocalHost(node)
    s = settings.ssh
    return SshHost(
        node,
        SshSettings(
            s.user,
            s.port,
            s.known_hosts,
            s.key_file,
            key_text,
            s.use_agent,
            s.connect_timeout_seconds,
            s.config_file,
        ),
    )


def last_clean_xid_check(raw_dir: Path, node: str) -> float | None:
    """When the node's kernel log was last read and found clean. The next XID check reads from
    there: a run where the check did not complete leaves no gap, and a critical XID found but
    not yet acted on is found again (``journalctl -k`` covers the current boot, so a repaired
    and rebooted node starts clean)."""
    try:
        entries = read_history(raw_dir, node)
    except Unreadable:
        return None
    for entry in reversed(entries):
        if kind(entry) != VERDICT:
            continue
        try:
            checks = {c["check"]: c["verdict"] for c in entry["checks"]}
            if checks.get(xid.NAME) in (Verdict.PASS.value, Verdict.WARN.value):
                return datetime.fromisoformat(entry["started_at"]).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _attempt(name: str, run: Callable[[Context], HealthCheck], ctx: Context) -> HealthCheck:
    started, kept = time.monotonic(), len(ctx.kept)
    try:
        outcome = run(ctx)
    except Unreachable as e:
        outcome = result(name, Verdict.TOOL_ERROR, Evidence(str(e)))
    except Exception as e:  # one check's surprise must not end the whole fleet's run
        outcome = result(
            name, Verdict.TOOL_ERROR, Evidence(f"the check itself failed ({type(e).__name__}: {e})")
        )
    outcome.seconds = time.monotonic() - started
    outcome.raw = ctx.kept[-1] if len(ctx.kept) > kept else None
    return outcome


def _below_gate(name: str, outcome: HealthCheck) -> bool:
    """Bandwidth under the gate (an nccl check), not any other failure with a threshold."""
    return (
        name.startswith(CheckName.NCCL)
        and outcome.verdict is Verdict.FAIL_HARDWARE
        and any(e.gate is not None for e in outcome.evidence)
    )


def _run_check(name: str, run: Callable[[Context], HealthCheck], ctx: Context) -> HealthCheck:
    """A tool error gets one more try; a second one makes the node SUSPECT for this check.
    Bandwidth below the gate also gets one more try (a busy fabric, a neighbour's job): the
    node fails only if the second run is slow too, and is SUSPECT if the retry cannot run."""
    first = _attempt(name, run, ctx)
    if _below_gate(name, first):
        second = _attempt(name, run, ctx)
        if second.verdict is Verdict.TOOL_ERROR:  # one slow run is not enough to drain on
            first.verdict, first.attempts = Verdict.SUSPECT, 2
            first.annotate(f" (the retry could not run: {second.detail})")
            return first
        second.attempts = 2
        if second.verdict is Verdict.FAIL_HARDWARE:
            second.annotate(" (again after a retry)")
        return second
    if first.verdict is not Verdict.TOOL_ERROR:
        return first
    second = _attempt(name, run, ctx)
    second.attempts = 2
    if second.verdict is Verdict.TOOL_ERROR:
        second.verdict = Verdict.SUSPECT
        second.annotate(" (again after a retry)")
        for item in second.evidence[1:]:
            item.detail = f"{item.detail} (again after a retry)"
    return second


def _connect(node: str, settings, key_text: str | None):
    """The node's one connection, open (an unreachable node is tried once more); its context
    closes it and never connects again."""
    try:
        return _host(node, settings, key_text).open()
    except Unreachable:
        return _host(node, settings, key_text).open()


def check_node(
    node: str,
    settings,
    level: int,
    key_text: str | None = None,
    checks: list[str] | None = None,
    suspects: bool = True,
    record: bool = True,
) -> NodeReport:
    """The node's checks, in the profile's order; with ``suspects``, its incident history too
    (a repeat suspect fails even when its checks pass, tasks.health.history). The facts the
    conformance check read go to the node's history; its verdict too with ``record`` (a fleet
    run records it once, after the pair test and the fleet comparison have had their say)."""
    started = time.monotonic()
    report = NodeReport(node, Verdict.PASS, started_at=datetime.now(UTC).isoformat(timespec="seconds"))
    since = last_clean_xid_check(settings.raw_dir, node)
    try:
        host = _connect(node, settings, key_text)
    except HostKeyRejected as e:
        report.checks.append(result(CheckName.SSH, Verdict.TOOL_ERROR, Evidence(str(e))))
    except Unreachable as e:
        report.checks.append(result(CheckName.SSH, Verdict.SUSPECT, Evidence(f"{e} (again after a retry)")))
    else:
        with host:
            ctx = Context(node, host, settings, level, Path(settings.raw_dir), since)
            for name in checks or settings.checks:
                if name == "nccl" and not settings.nccl.enabled:
                    continue
                if time.monotonic() - started > settings.node_timeout_seconds:
                    report.checks.append(
                        result(name, Verdict.TOOL_ERROR, Evidence("not run: the node's time budget ran out"))
                    )
                    continue
                outcome = _run_check(name, CHECKS[name].run, ctx)
                report.checks.append(outcome)
                if gpu_count.no_gpus(outcome):
                    break  # nothing else can run on a node without GPUs or GPU tools
            if ctx.facts:
                report.facts = dict(ctx.facts)
                try:
                    record_facts(settings.raw_dir, node, report.facts)
                except (CkptopsError, OSError) as e:  # that node's tool error; the sweep goes on
                    report.checks.append(_unrecorded("facts", e))
    repeat = suspect_check(settings.raw_dir, node, settings) if suspects else None
    if repeat is not None:
        report.checks.append(repeat)
    report.verdict = worst(c.verdict for c in report.checks)
    report.seconds = time.monotonic() - started
    if record:
        record_verdict(settings.raw_dir, report)
    return report


def pair_test(node: str, known_good: str, settings, key_text: str | None = None) -> HealthCheck:
    """A two-node all_reduce (Ring) of ``node`` with a known-good node, launched from ``node``."""
    pairs = settings.pairs
    argv = [part.format(a=node, b=known_good) for part in pairs.command]
    name = CheckName.NCCL_PAIR.with_peer(known_good)

    def run_pair(ctx: Context) -> HealthCheck:
        output = ctx.command(name, argv, pairs.timeout_seconds)
        if output.timed_out:
            return result(
                name, Verdict.TOOL_ERROR, Evidence(f"pair test timed out after {output.seconds:.0f}s")
            )
        gates = Gates.from_settings(settings.nccl, pairs)
        return classify_allreduce(output.stdout + output.stderr, output.exit_code, gates, name)

    try:
        with _connect(node, settings, key_text) as host:
            return _run_check(
                name, run_pair, Context(node, host, settings, settings.level, Path(settings.raw_dir))
            )
    except (Unreachable, HostKeyRejected) as e:
        return result(name, Verdict.TOOL_ERROR, Evidence(str(e)))


@dataclass
class HealthRun:
    reports: list[NodeReport]
    level: int
    seconds: float

    def counts(self) -> dict[str, int]:
        counted: dict[str, int] = {}
        for r in self.reports:
            counted[r.verdict.value] = counted.get(r.verdict.value, 0) + 1
        return counted


def run_health(
    settings,
    nodes: list[str],
    level: int | None = None,
    admit: bool = False,
    progress: Callable[[NodeReport], None] | None = None,
) -> HealthRun:
    """Check ``nodes`` in parallel; with pairs enabled (or ``admit``), pair-test the nodes that
    passed against the known-good node. ``admit`` runs the spare admission set: r3, single-node
    NCCL, and the pair test (DCGM at level 3, or ``level`` if higher). With the conformance
    check, every node's facts are then compared with the fleet's (tasks.health.fleet) before
    the verdicts are recorded."""
    level = max(3, level or 3) if admit else (level or settings.level)
    started = time.monotonic()
    key_text = ssh_key_text(settings)
    os.makedirs(settings.raw_dir, mode=0o755, exist_ok=True)  # no umask makes it group-writable
    compared = conformance.NAME in settings.checks

    def one(node):
        # Recorded once, after every check: the pair test's, and the fleet comparison's.
        report = check_node(node, settings, level, key_text, suspects=not admit, record=False)
        if (
            (admit or settings.pairs.enabled)
            and settings.pairs.known_good
            and node != settings.pairs.known_good
            and not report.verdict.is_failure
            and report.verdict is not Verdict.SUSPECT
        ):
            report.checks.append(pair_test(node, settings.pairs.known_good, settings, key_text))
            report.verdict = worst(c.verdict for c in report.checks)
        if not compared:
            _record(settings.raw_dir, report)
        if progress:
            progress(report)
        return report

    with ThreadPoolExecutor(max_workers=max(1, min(settings.concurrency, len(nodes)))) as pool:
        reports = list(pool.map(one, nodes))
    if compared:
        compare_fleet(reports, settings, admit)
        for report in reports:
            _record(settings.raw_dir, report)
    return HealthRun(reports, level, time.monotonic() - started)


def _record(raw_dir: Path, report: NodeReport) -> None:
    """The node's verdict into its history; a history that cannot take it (a link planted at
    the node's folder, a full disk) is that node's TOOL_ERROR, and the sweep goes on."""
    try:
        record_verdict(raw_dir, report)
    except (CkptopsError, OSError) as e:
        report.checks.append(_unrecorded("verdict", e))
        report.verdict = worst(c.verdict for c in report.checks)


def _unrecorded(what: str, error: Exception) -> HealthCheck:
    """The node's history could not take its ``what``: a tool error of that node."""
    return result(CheckName.SUSPECT_HISTORY, Verdict.TOOL_ERROR, Evidence(f"{what} not recorded: {error}"))


def compare_fleet(reports: list[NodeReport], settings, admit: bool) -> None:
    """Each node's facts against the majority of its fleet: the nodes checked now, and the latest
    recorded facts of the profile's other nodes (a recovery checks only its suspects); a spare's
    (``admit``) against the fleet's recorded facts only. Spares never count in the fleet."""
    facts = {r.node: r.facts for r in reports if r.facts}
    checked = {r.node for r in reports}
    others = [n for n in resolve_nodes(settings) if n not in checked and n not in settings.spares]
    recorded = fleet.recorded(settings.raw_dir, others, settings.conformance.max_age_days)
    reference = {node: found for node, found in recorded.items() if found}
    if admit:
        fleet.judge(reports, facts, reference, settings, admit, "recorded nodes")
    else:
        fleet_now = {node: found for node, found in facts.items() if node not in settings.spares}
        fleet.judge(reports, facts, reference | fleet_now, settings, admit, "nodes")
