"""The load report: what the drill's loader loaded, on which layout, and what it checked.

Written by the loader (rank 0, after gathering every rank's checks) and read by the drill; one
type for both, so a field the loader fills is a field the drill knows. Plain data, no torch: the
drill process never imports megatron.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.errors import CkptopsError
from tasks.storage.local import atomic_write


@dataclass
class RankCheck:
    """One rank's sample of loaded tensors compared with the stored bytes."""

    rank: int
    compared: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    node: str = ""  # the Slurm node (or host) the rank ran on


@dataclass
class LoadReport:
    iteration: int | None = None
    consumed_train_samples: int | None = None
    skipped_train_samples: int = 0  # the scheduler does not step for these (--iterations-to-skip)
    scheduler: dict | None = None
    lr: float | None = None
    load_seconds: float = 0.0
    repeat_load_seconds: list[float] = field(default_factory=list)  # further loads into the same process
    world_size: int = 0
    layout: dict = field(default_factory=dict)  # the drill's TP, PP, DP
    checkpoint_layout: dict = field(default_factory=dict)  # the job's, from its args
    model: str = "gpt"  # or the job's model provider
    inferred: list[str] = field(default_factory=list)  # args the tensor shapes settled
    optimizer_loaded: bool = False
    optimizer_format: str | None = None  # the distributed optimizer's sharding type
    rng_loaded: bool = False
    notes: list[str] = field(default_factory=list)
    ranks: list[RankCheck] = field(default_factory=list)

    @property
    def compared(self) -> int:
        return sum(len(r.compared) for r in self.ranks)

    @property
    def mismatches(self) -> list[str]:
        return [f"rank {r.rank}: {key}" for r in self.ranks for key in r.mismatches]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "LoadReport":
        data = dict(data)
        data["ranks"] = [RankCheck(**r) for r in data.get("ranks", [])]
        return cls(**data)


def write_report(path: Path, report: LoadReport) -> None:
    atomic_write(Path(path), report.to_json().encode())


def read_report(path: Path) -> LoadReport:
    try:
        return LoadReport.from_dict(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise CkptopsError(f"{path}: the load wrote no report") from None
    except (OSError, ValueError, TypeError) as e:
        raise CkptopsError(f"{path}: unreadable load report ({e})") from None


def error_path(report: Path, rank: int) -> Path:
    return Path(f"{report}.rank{rank}.error")


def write_error(report: Path, rank: int, text: str, usage: bool) -> None:
    """A rank's own first error, one line: torchrun and srun only say that a rank exited."""
    atomic_write(error_path(report, rank), json.dumps({"rank": rank, "error": text, "usage": usage}).encode())


def first_error(report: Path) -> dict | None:
    """The error a rank recorded first (by the time it was written), if any did."""
    found = []
    for path in Path(report).parent.glob(f"{Path(report).name}.rank*.error"):
        try:
            found.append((path.stat().st_mtime_ns, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    return min(found, key=lambda item: item[0])[1] if found else None
