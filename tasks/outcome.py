"""One vocabulary for what a check found, across verification, drills, resume validation and
node health.

A ``Check`` names what was checked and its outcome, with what was expected and observed, a
one-line detail and the file at fault. Verification, drills and resume validation decide with
``Outcome``; every check, a node-health one too, carries one. Node health says more in its
``Verdict``, the words an operator drains by (after Meta GCM's one exit-code type), which a
health check keeps beside its outcome with its evidence (tasks.health.verdict).
"""

from dataclasses import dataclass, fields
from enum import StrEnum


class Outcome(StrEnum):
    PASS = "pass"
    WARN = "warn"  # passed, with something a human should know
    FAIL = "fail"
    UNCHECKED = "unchecked"  # could not be checked from what there was: not a pass


class Verdict(StrEnum):
    """A node-health check's outcome; a node's verdict is the worst of its checks'."""

    PASS = "PASS"
    WARN = "WARN"
    TOOL_ERROR = "TOOL_ERROR"  # the check could not tell (timeout, crash, unknown exit code)
    SUSPECT = "SUSPECT"  # a tool error that repeated on this node after a retry
    FAIL_CONFIG = "FAIL_CONFIG"  # a setting to fix (persistence mode, a non-MPI build), not hardware
    FAIL_HARDWARE = "FAIL_HARDWARE"

    @property
    def rank(self) -> int:
        return list(Verdict).index(self)

    @property
    def is_failure(self) -> bool:
        return self in (Verdict.FAIL_CONFIG, Verdict.FAIL_HARDWARE)

    @property
    def outcome(self) -> Outcome:
        """What the verdict means as every other check says it: a tool error or a suspect is not
        a pass, and not a fail either."""
        if self in (Verdict.PASS, Verdict.WARN):
            return Outcome(self.value.lower())
        return Outcome.FAIL if self.is_failure else Outcome.UNCHECKED

    @property
    def exit_code(self) -> int:
        """0 when the node may run jobs (PASS, WARN), 1 when it may not or we could not tell."""
        return 0 if self in (Verdict.PASS, Verdict.WARN) else 1


def worst(verdicts) -> Verdict:
    return max(verdicts, key=lambda v: v.rank, default=Verdict.PASS)


@dataclass
class Check:
    name: str
    outcome: Outcome
    detail: str = ""
    expected: str = ""
    observed: str = ""
    file: str | None = None

    @property
    def ok(self) -> bool:
        """Nothing against it: passed, or passed with a warning."""
        return self.outcome in (Outcome.PASS, Outcome.WARN)

    @property
    def failed(self) -> bool:
        return self.outcome is Outcome.FAIL

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(Check)} | {"outcome": self.outcome.value}

    @classmethod
    def from_dict(cls, data: dict) -> "Check":
        """A check as ``to_dict`` writes it, or as ckptops wrote it before the outcome was a word
        (``ok``: true or false; resume checks also null, for not checkable)."""
        data = dict(data)
        if "outcome" not in data and "ok" in data:
            ok = data.pop("ok")
            data["outcome"] = Outcome.UNCHECKED if ok is None else Outcome.PASS if ok else Outcome.FAIL
        return cls(**{f.name: data[f.name] for f in fields(Check) if f.name in data})


def passed(name: str, detail: str = "", **kwargs) -> Check:
    return Check(name, Outcome.PASS, detail, **kwargs)


def failed(name: str, detail: str = "", **kwargs) -> Check:
    return Check(name, Outcome.FAIL, detail, **kwargs)
