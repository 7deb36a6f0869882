"""Triage measured on the labelled corpus (tests/data/triage, labels in tests/test_triage.py's
FIXTURES and in SOURCES.md): the share of cases whose class is right, and of the cases labelled
with a suspect node, the share whose suspects are exactly right.

    python -m tests.triage_accuracy

Known misses (KNOWN_MISSES, each with its reason in SOURCES.md) are counted as wrong."""

from dataclasses import dataclass

from tasks.recovery.triage import triage
from tests.test_triage import FIXTURES, paths_of


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


if __name__ == "__main__":
    print(measure().report())
