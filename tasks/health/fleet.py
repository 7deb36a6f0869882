"""The fleet's side of the conformance check: each node's facts against the strict majority of
its fleet's. A node alone cannot show that it is the odd one out (its driver may be newer and
fine); against the nodes it runs with, one that differs is the likely reason a pipeline got
slower after it joined.

Three uses: a health run compares each node with the nodes checked with it; a spare's admission
compares the spare with the fleet's recorded facts (the latest each fleet node's history holds,
so the fleet need not be checked again), with ``health.conformance.spares`` deciding whether a
spare that differs is refused or admitted with a WARN; and a resume whose throughput dropped
names the relaunched nodes whose recorded facts differ from the rest.

Majority is strict (more than half of the nodes that read the fact): a tie, or a fleet of one,
decides nothing, and the check says so."""

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tasks.health.checks.conformance import FACTS, NAME, canonical, same
from tasks.health.history import latest_facts
from tasks.health.verdict import Evidence, HealthCheck
from tasks.outcome import Verdict, worst


@dataclass(frozen=True)
class Difference:
    node: str
    fact: str
    value: str
    expected: str
    origin: str  # where the expected value comes from: "N of M nodes"

    def line(self) -> str:
        return f"{self.fact} {self.value}, expected {self.expected} ({self.origin})"


@dataclass
class Majority:
    nodes: int  # nodes with facts
    values: dict[str, str] = field(default_factory=dict)  # fact -> the majority's value
    origin: dict[str, str] = field(default_factory=dict)  # fact -> "N of M nodes"
    undecided: list[str] = field(default_factory=list)  # facts without a strict majority, and why

    def note(self) -> str:
        """What the comparison could not decide ("" when it decided every fact read)."""
        if self.nodes < 2:
            return f"no fleet majority: {self.nodes} node{'s' if self.nodes != 1 else ''} with facts"
        return f"no majority for {'; '.join(self.undecided)}" if self.undecided else ""


def majority(facts_by_node: dict[str, dict[str, str]], noun: str = "nodes") -> Majority:
    found = Majority(len(facts_by_node))
    for fact in FACTS:
        values = [canonical(facts[fact]) for facts in facts_by_node.values() if fact in facts]
        if len(values) < 2:
            continue
        (top, count), *_ = Counter(values).most_common()
        if 2 * count > len(values):
            found.values[fact], found.origin[fact] = top, f"{count} of {len(values)} {noun}"
        else:
            found.undecided.append(f"{fact} (at most {count} of {len(values)} {noun} agree)")
    return found


def differences(node: str, facts: dict[str, str], found: Majority) -> list[Difference]:
    return [
        Difference(node, fact, facts[fact], value, found.origin[fact])
        for fact, value in found.values.items()
        if fact in facts and not same(facts[fact], value)
    ]


def conformance_of(report) -> HealthCheck | None:
    return next((c for c in report.checks if c.name == NAME), None)


def _fail(check: HealthCheck, found: list[Difference]) -> None:
    """The node differs from its fleet: FAIL_CONFIG, the differences first (what it read when
    it passed is no longer the news; what else it found stays)."""
    evidence = [Evidence(d.line()) for d in found]
    kept = [] if check.verdict is Verdict.PASS else check.evidence
    check.evidence = kept + evidence if check.verdict is Verdict.FAIL_CONFIG else evidence + kept
    check.detail = check.evidence[0].detail
    check.verdict = Verdict.FAIL_CONFIG


def _as_spare(check: HealthCheck, policy: str) -> None:
    if check.verdict is not Verdict.FAIL_CONFIG:
        return
    if policy == "warn":
        check.verdict = Verdict.WARN
        check.annotate(" (admitted with a warning: health.conformance.spares is warn)")
    else:
        check.annotate(" (not admitted: health.conformance.spares is refuse)")


def judge(
    reports,
    facts: dict[str, dict[str, str]],
    reference: dict[str, dict[str, str]],
    settings,
    admit: bool,
    noun: str,
) -> None:
    """Compare each report's node (its ``facts``) with the majority of ``reference`` (the nodes
    checked with it, or for spares the fleet's recorded facts); a node that differs fails its
    conformance check, and its verdict follows. Spares (``admit``) that differ from pins or
    fleet are refused or warned about as ``health.conformance.spares`` says."""
    rule = settings.conformance
    found = majority(reference, noun) if rule.majority else None
    for report in reports:
        check = conformance_of(report)
        if check is None:
            continue
        if found is not None and report.node in facts:
            differ = differences(report.node, facts[report.node], found)
            if differ:
                _fail(check, differ)
            elif found.note():
                check.annotate(f" ({found.note()})")
        if admit:
            _as_spare(check, rule.spares)
        report.verdict = worst(c.verdict for c in report.checks)


def recorded(raw_dir: Path, nodes: list[str], max_age_days: float) -> dict[str, dict[str, str] | None]:
    """Each node's latest recorded facts (None for a node never read, or not within
    ``max_age_days``: health.conformance.max_age_days)."""
    return {node: latest_facts(raw_dir, node, max_age_days) for node in nodes}


def relaunched_note(facts_by_node: dict[str, dict[str, str] | None]) -> str:
    """For a resume that got slower: which of the relaunched nodes differ from the rest, by
    their recorded facts, or that none do, or that nothing was recorded to tell."""
    known = {node: facts for node, facts in facts_by_node.items() if facts}
    missing = [node for node, facts in facts_by_node.items() if not facts]
    unrecorded = f"; no conformance facts recorded for {', '.join(missing)}" if missing else ""
    if not known:
        return (
            f"no conformance facts recorded for the relaunched nodes ({', '.join(missing) or 'none known'})"
        )
    found = majority(known, "relaunched nodes")
    differ = [d for node, facts in known.items() for d in differences(node, facts, found)]
    if differ:
        named = "; ".join(f"{d.node}: {d.line()}" for d in differ)
        return f"relaunched nodes that differ from the rest: {named}{unrecorded}"
    undecided = f" ({found.note()})" if found.note() else ""
    none = f"none of the {len(known)} relaunched nodes with recorded facts differs from the rest"
    return none + undecided + unrecorded
