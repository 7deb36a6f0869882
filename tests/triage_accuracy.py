"""Triage measured on the labelled corpus (tests/data/triage, labels in tests/test_triage.py's
FIXTURES and in SOURCES.md): the share of cases whose class is right, and of the cases labelled
with a suspect node, the share whose suspects are exactly right. Hang localisation on the Flight
Recorder dumps others recorded (tests/data/flight_recorder, labels beside each case): the cases
whose suspect ranks are exactly the reference's missing ranks, and the injected ranks named. NaN
attribution on the rerun state machine's verdicts (the corpus's public first reruns and the runs in
tests/data/megatron/rerun, labels there): the class (the GPU, the data, undecided), the GPU's node,
and the iteration where labelled.

    python -m tests.triage_accuracy

Known misses (KNOWN_MISSES, each with its reason in SOURCES.md) are counted as wrong."""

import re
from dataclasses import dataclass
from pathlib import Path

from tasks.recovery.triage import triage
from tasks.recovery.triage.flight_recorder import flight_recorder
from tests.test_triage import FIXTURES, paths_of

DUMPS = Path(__file__).parent / "data" / "flight_recorder"
RERUNS = Path(__file__).parent / "data" / "megatron" / "rerun"
# The rerun state machine's verdicts made here (tests/data/megatron/rerun/SOURCES.md): class,
# suspects, iteration.
RERUN_LABELS = {
    "first_rerun_reproducible.log": ("numerics", ("vm",), 6),
    "second_rerun_reproducible.log": ("data", (), 6),
    "second_rerun_reproducible_tracker.txt": ("data", (), 6),
    "first_rerun_not_reproducible.log": ("hardware", ("vm",), None),
    "first_rerun_not_reproducible_tracker.txt": ("hardware", ("vm",), None),
}


@dataclass(frozen=True)
class Outcome:
    case: str
    cls: str  # the label
    got_cls: str
    suspects: tuple[str, ...]  # the label
    got_suspects: tuple[str, ...]

    @property
    def class_right(self) -> bool:
        return self.got_cls == self.cls

    @property
    def suspects_right(self) -> bool:
        return self.got_suspects == self.suspects


@dataclass(frozen=True)
class Accuracy:
    outcomes: tuple[Outcome, ...]

    @property
    def cases(self) -> int:
        return len(self.outcomes)

    @property
    def class_right(self) -> int:
        return sum(o.class_right for o in self.outcomes)

    @property
    def with_suspect(self) -> tuple[Outcome, ...]:
        return tuple(o for o in self.outcomes if o.suspects)

    @property
    def suspect_right(self) -> int:
        return sum(o.suspects_right for o in self.with_suspect)

    @property
    def spurious_suspects(self) -> tuple[Outcome, ...]:
        """Cases labelled with no suspect for which triage named one anyway."""
        return tuple(o for o in self.outcomes if not o.suspects and o.got_suspects)

    def report(self) -> str:
        lines = [
            f"class: {self.class_right}/{self.cases} right ({100 * self.class_right / self.cases:.1f}%)",
            f"suspect: {self.suspect_right}/{len(self.with_suspect)} right "
            f"({100 * self.suspect_right / max(1, len(self.with_suspect)):.1f}%) of the cases labelled "
            f"with a suspect node; {len(self.spurious_suspects)} of the "
            f"{self.cases - len(self.with_suspect)} labelled with none named one",
        ]
        for o in self.outcomes:
            if not o.class_right or not o.suspects_right:
                lines.append(
                    f"  miss: {o.case}: class {o.got_cls} (label {o.cls}), suspects "
                    f"{list(o.got_suspects)} (label {list(o.suspects)})"
                )
        return "\n".join(lines)


def measure() -> Accuracy:
    outcomes = []
    for row in FIXTURES:
        relative, cls, _first, suspects = row[:4]
        result = triage(paths_of(relative))
        outcomes.append(Outcome(relative, cls, result.cls, tuple(suspects), tuple(result.suspect_nodes)))
    return Accuracy(tuple(outcomes))


@dataclass(frozen=True)
class Hang:
    case: str
    missing: tuple[int, ...]  # the reference analyser's missing ranks
    injected: tuple[int, ...]  # the ranks the fault was injected into
    got: tuple[int, ...]


def hang_cases() -> list[tuple[Path, tuple[int, ...], tuple[int, ...]]]:
    """Each recorded case: its folder, the reference's missing ranks (the last column of each row
    of reference.txt) and the injected ranks (fault_injection.log's "Fault ranks: [..]")."""
    cases = []
    for folder in sorted(p.parent for p in DUMPS.glob("*/*/reference.txt")):
        rows = (folder / "reference.txt").read_text().splitlines()[1:]
        missing = sorted({int(r) for row in rows if row.strip() for r in row.rsplit("|", 1)[1].split(",")})
        injected = re.search(r"Fault ranks: \[([\d, ]+)\]", (folder / "fault_injection.log").read_text())
        cases.append((folder, tuple(missing), tuple(int(r) for r in injected[1].split(","))))
    return cases


def measure_hangs() -> list[Hang]:
    return [
        Hang(f"{f.parent.name}/{f.name}", missing, injected, tuple(flight_recorder(f).suspect_ranks))
        for f, missing, injected in hang_cases()
    ]


def hang_report(hangs: list[Hang]) -> str:
    exact = sum(h.got == h.missing for h in hangs)
    injected = sum(len(h.injected) for h in hangs)
    named = sum(len(set(h.injected) & set(h.got)) for h in hangs)
    wrong = sum(len(set(h.got) - set(h.injected)) for h in hangs)
    lines = [
        f"hang localisation (Flight Recorder): {exact}/{len(hangs)} cases name exactly the reference's "
        f"missing ranks; {named} of {injected} injected ranks named, {wrong} ranks named that were not"
    ]
    lines += [
        f"  miss: {h.case}: {list(h.got)} (reference {list(h.missing)})" for h in hangs if h.got != h.missing
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class NanVerdict:
    case: str
    label: tuple[str, tuple[str, ...], int | None]  # class, suspects, iteration (None: unlabelled)
    got: tuple[str, tuple[str, ...], int | None]

    @property
    def right(self) -> bool:
        cls, suspects, iteration = self.label
        return self.got[:2] == (cls, suspects) and (iteration is None or self.got[2] == iteration)


def _rerun_line(text: str) -> bool:
    return "rerun_state_machine" in text or "Unexpected result" in text


def measure_nans() -> list[NanVerdict]:
    """The corpus's cases with a rerun state machine's line, and the runs made here."""
    cases = [
        (relative, (cls, tuple(suspects), None), paths_of(relative))
        for relative, cls, _first, suspects, *_ in FIXTURES
        if any(_rerun_line(p.read_text(errors="replace")) for p in paths_of(relative))
    ]
    cases += [(f"rerun/{name}", label, [RERUNS / name]) for name, label in RERUN_LABELS.items()]
    found = []
    for case, label, paths in cases:
        result = triage(paths)
        found.append(
            NanVerdict(case, label, (result.cls, tuple(result.suspect_nodes), result.anomaly_iteration))
        )
    return found


def nan_report(verdicts: list[NanVerdict]) -> str:
    right = sum(v.right for v in verdicts)
    labelled = [v for v in verdicts if v.label[2] is not None]
    lines = [
        f"NaN attribution (rerun state machine): {right}/{len(verdicts)} verdicts right (class and GPU "
        f"node; the iteration too in the {len(labelled)} labelled with one)"
    ]
    lines += [f"  miss: {v.case}: {v.got} (label {v.label})" for v in verdicts if not v.right]
    return "\n".join(lines)


if __name__ == "__main__":
    print(measure().report())
    print(hang_report(measure_hangs()))
    print(nan_report(measure_nans()))
