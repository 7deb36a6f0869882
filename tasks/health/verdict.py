"""The one verdict type every health check returns, with its evidence.

Every check, whatever tool it runs, ends in one of these words; a node's verdict is the worst
of its checks'. Evidence says what was seen (test, GPU, error id and severity, bandwidth against
the gate) so an operator can act without opening the raw output, which is kept anyway.
"""

from dataclasses import asdict, dataclass, field
from enum import StrEnum


class Verdict(StrEnum):
    PASS = "PASS"
    WARN = "WARN"
    TOOL_ERROR = "TOOL_ERROR"  # the check could not tell (timeout, crash, unknown exit code)
    SUSPECT = "SUSPECT"  # a tool error that repeated on this node after a retry
    FAIL_CONFIG = "FAIL_CONFIG"  # a setting to fix (persistence mode, a non-MPI build), not hardware
    FAIL_HARDWARE = "FAIL_HARDWARE"

    @property
    def rank(self) -> int:
        return _ORDER.index(self)

    @property
    def failed(self) -> bool:
        return self in (Verdict.FAIL_CONFIG, Verdict.FAIL_HARDWARE)

    @property
    def exit_code(self) -> int:
        """0 when the node may run jobs (PASS, WARN), 1 when it may not or we could not tell."""
        return 0 if self in (Verdict.PASS, Verdict.WARN) else 1


_ORDER = [
    Verdict.PASS,
    Verdict.WARN,
    Verdict.TOOL_ERROR,
    Verdict.SUSPECT,
    Verdict.FAIL_CONFIG,
    Verdict.FAIL_HARDWARE,
]


def worst(verdicts) -> Verdict:
    return max(verdicts, key=lambda v: v.rank, default=Verdict.PASS)


@dataclass
class Evidence:
    detail: str
    test: str | None = None
    gpu: int | None = None
    error_id: int | None = None
    severity: str | None = None
    value: float | None = None
    gate: float | None = None


@dataclass
class CheckResult:
    check: str
    verdict: Verdict
    evidence: list[Evidence] = field(default_factory=list)
    exit_code: int | None = None
    seconds: float = 0.0
    raw: str | None = None  # where the raw output was kept
    attempts: int = 1

    @property
    def summary(self) -> str:
        return self.evidence[0].detail if self.evidence else ""

    def to_dict(self) -> dict:
        data = asdict(self)
        data["verdict"] = self.verdict.value
        return data


def result(check: str, verdict: Verdict, *evidence: Evidence, exit_code: int | None = None) -> CheckResult:
    return CheckResult(check, verdict, list(evidence), exit_code)
