"""The one verdict type every health check returns, with its evidence.

Every check, whatever tool it runs, ends in one of these words; a node's verdict is the worst
of its checks'. Evidence says what was seen (test, GPU, error id and severity, bandwidth against
the gate) so an operator can act without opening the raw output, which is kept anyway.
"""

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Literal

from tasks.outcome import Check, Verdict


class CheckName(StrEnum):
    """The node-health checks (one file each under tasks/health/checks), as reports name them."""

    SSH = "ssh"  # the node could not be reached to run the others
    GPU_COUNT = "gpu-count"
    GPU_PROCESSES = "gpu-processes"  # compute processes on the GPUs that no running Slurm job owns
    NVLINK = "nvlink"
    ROW_REMAP = "row-remap"
    RECOVERY_ACTION = "recovery-action"
    XID = "xid"
    DCGM_DIAG = "dcgm-diag"
    NCCL = "nccl"
    NCCL_PAIR = "nccl-pair"  # named with its known-good peer: nccl-pair-<node>
    CONFORMANCE = "conformance"  # versions, clocks, power limit, NIC firmware and rate vs pins and fleet
    SUSPECT_HISTORY = "suspect-history"  # a repeat suspect of incidents (tasks/health/history.py)

    def with_peer(self, node: str) -> str:
        return f"{self.value}-{node}"


# The checks a profile's health.checks may list: those run on a node, one file each under
# tasks/health/checks, in the order they run by default (the others are the run's own: ssh, the
# pair test, the history).
NodeCheck = Literal[
    tuple(
        check.value
        for check in (
            CheckName.GPU_COUNT,
            CheckName.GPU_PROCESSES,
            CheckName.RECOVERY_ACTION,
            CheckName.ROW_REMAP,
            CheckName.XID,
            CheckName.NVLINK,
            CheckName.DCGM_DIAG,
            CheckName.NCCL,
            CheckName.CONFORMANCE,
        )
    )
]


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
class HealthCheck(Check):
    """A node-health check: the shared ``Check`` (detail: the first evidence line) with its
    ``Verdict``, all its evidence and how it ran. Its outcome follows its verdict."""

    verdict: Verdict = Verdict.PASS
    evidence: list[Evidence] = field(default_factory=list)
    exit_code: int | None = None
    seconds: float = 0.0
    raw: str | None = None  # where the raw output was kept
    attempts: int = 1

    def __setattr__(self, name, value) -> None:
        super().__setattr__(name, value)
        if name == "verdict":
            super().__setattr__("outcome", value.outcome)

    def annotate(self, text: str) -> None:
        """Add to what the check says (its detail and its first evidence line)."""
        self.detail += text
        if self.evidence:
            self.evidence[0].detail += text

    def to_dict(self) -> dict:
        data = asdict(self)
        return data | {"outcome": self.outcome.value, "verdict": self.verdict.value}


def result(check: str, verdict: Verdict, *evidence: Evidence, exit_code: int | None = None) -> HealthCheck:
    return HealthCheck(
        check,
        verdict.outcome,
        evidence[0].detail if evidence else "",
        verdict=verdict,
        evidence=list(evidence),
        exit_code=exit_code,
    )
