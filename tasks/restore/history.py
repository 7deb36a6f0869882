"""Drill history: one JSON line per drill, kept with the job's data.

``<save_dir>/.ckptops-history/drills.jsonl`` survives a Prefect database reset (and a Prefect
server that was never there); each drill's load log and load report are kept beside it in
``.ckptops-history/drills/``, and the scratch folders drills made in ``scratch.jsonl``. The
trend (restore window per night per source, against the budget) is drawn from it for the UI and
the terminal, and so is the estimate of the restore window at production size.
"""

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from tasks.checkpoint.layout import HISTORY
from tasks.plots import markdown_image, png, pyplot
from tasks.storage.local import append_jsonl, own_folder, read_jsonl


class DrillSource(StrEnum):
    """Where a drill restores from: the shared store the job saves to, or the archive's copy."""

    SHARED = "shared"
    ARCHIVE = "archive"


DRILLS = "drills.jsonl"


def history_path(save_dir: Path) -> Path:
    return Path(save_dir) / HISTORY / DRILLS


def drill_files(save_dir: Path, drill_id: str) -> tuple[Path, Path]:
    """Where a drill's load log and load report are kept: ``.ckptops-history/drills/<id>.log``
    and ``<id>.load.json``, beside the history line, not in the scratch the drill removes."""
    folder = own_folder(save_dir, HISTORY, "drills")
    return folder / f"{drill_id}.log", folder / f"{drill_id}.load.json"


def append_drill(save_dir: Path, report) -> None:
    append_jsonl(own_folder(save_dir, HISTORY) / DRILLS, report.to_dict())


def read_drills(save_dir: Path) -> list[dict]:
    """Every recorded drill, oldest first; a line that is not a drill's record (a torn line from
    a crash mid-append, bytes ckptops did not write, an entry without the fields the trend and
    the estimate read) is skipped with one warning naming the file and line."""
    return read_jsonl(history_path(save_dir), _is_drill)


SCRATCH = "scratch.jsonl"


def record_scratch(save_dir: Path, entry: dict) -> None:
    """A drill's scratch folder (its path, device, inode and owner token), recorded before the
    drill uses it: the only proof that a folder in the scratch dir is one ckptops may remove."""
    append_jsonl(own_folder(save_dir, HISTORY) / SCRATCH, entry)


def _is_scratch(entry: dict) -> bool:
    return isinstance(entry.get("token"), str) and all(
        isinstance(entry.get(key), int) for key in ("device", "inode")
    )


def made_scratch(save_dir: Path) -> dict[str, dict]:
    """Every scratch folder this job's drills recorded, by owner token."""
    return {entry["token"]: entry for entry in read_jsonl(Path(save_dir) / HISTORY / SCRATCH, _is_scratch)}


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_drill(entry: dict) -> bool:
    """Whether a line holds the fields every reader of a drill's record (the trend, the
    estimate, the drilled layouts) takes as ``DrillReport.to_dict`` writes them."""
    phases, checks, layout = entry.get("phases", []), entry.get("checks", []), entry.get("layout") or {}
    return (
        isinstance(entry.get("source"), str)
        and isinstance(entry.get("started_at"), str)
        and isinstance(entry.get("ok"), bool)
        and _number(entry.get("window_seconds"))
        and _number(entry.get("budget_seconds"))
        and isinstance(phases, list)
        and all(
            isinstance(p, dict)
            and isinstance(p.get("name"), str)
            and _number(p.get("seconds"))
            and _number(p.get("bytes"))
            for p in phases
        )
        and isinstance(checks, list)
        and all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("outcome", ""), str)
            for c in checks
        )
        and isinstance(layout, dict)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in layout.values())
    )


def drilled_layouts(save_dir: Path) -> dict[tuple[int, int], str]:
    """The layouts (TP, PP) a passing drill loaded this job's checkpoints onto, each with the
    newest such drill's id: the reshardings ckptops has seen load."""
    found = {}
    for drill in read_drills(save_dir):
        shape = drill.get("layout") or {}
        if drill.get("ok") is True and shape.get("tensor_parallel") and shape.get("pipeline_parallel"):
            found[(int(shape["tensor_parallel"]), int(shape["pipeline_parallel"]))] = str(drill.get("id"))
    return found


def phase(drill: dict, name: str) -> dict | None:
    return next((p for p in drill.get("phases", []) if p["name"] == name), None)


# Below this size a drill's phases are mostly fixed costs (opening files, thread start-up), and
# scaling their throughput up to terabytes says nothing about the storage.
REPRESENTATIVE_BYTES = 1 << 30


@dataclass
class Estimate:
    source: str
    seconds: float
    measured_bytes: int

    @property
    def representative(self) -> bool:
        return self.measured_bytes >= REPRESENTATIVE_BYTES

    def line(self, size_bytes: int, budget_seconds: float) -> str:
        head = (
            f"predicted {self.source} restore window for {size_bytes / 1e12:.1f} TB: "
            f"{self.seconds / 60:.1f} min"
        )
        if not self.representative:
            return (
                f"{head}; measured on only {self.measured_bytes / 1e6:.1f} MB, where fixed costs dominate: "
                "not representative"
            )
        verdict = "within" if self.seconds <= budget_seconds else "OVER"
        return f"{head}, {verdict} the {budget_seconds / 60:.0f} min budget"


def estimate(drills: list[dict], size_bytes: int) -> dict[str, Estimate]:
    """Predicted restore window per source for a checkpoint of ``size_bytes``: each phase of the
    newest drill that ran all three phases (passed or over budget: its speeds are the current
    ones) scaled to that size (size / measured throughput), summed."""
    predicted = {}
    for source in DrillSource:
        complete = [d for d in drills if d["source"] == source and len(d.get("phases", [])) == 3]
        if not complete:
            continue
        phases = complete[-1]["phases"]
        if phases and all(p["seconds"] > 0 and p["bytes"] > 0 for p in phases):
            seconds = sum(size_bytes * p["seconds"] / p["bytes"] for p in phases)
            predicted[source] = Estimate(source, seconds, max(p["bytes"] for p in phases))
    return predicted


@dataclass
class History:
    """A job's drills and what they predict, as the CLI and the UI both show them."""

    drills: list[dict]
    size_bytes: int | None  # drill.estimate_for_bytes
    predicted: dict[str, Estimate]
    budgets: dict[str, float]

    def estimate_lines(self) -> list[str]:
        return [e.line(self.size_bytes, self.budgets[e.source]) for e in self.predicted.values()]


def history(profile) -> History:
    drills = read_drills(profile.job.save_dir)
    size = profile.drill.estimate_for_bytes if profile.drill else None
    budgets = profile.drill.budget_seconds.model_dump() if profile.drill else {}
    return History(drills, size, estimate(drills, size) if size else {}, budgets)


def trend_rows(drills: list[dict]) -> list[dict]:
    rows = []
    for d in drills:
        fetch = phase(d, "copy") or phase(d, "download") or {}
        row = {
            "when (UTC)": d["started_at"].replace("T", " ")[5:16],
            "source": d["source"],
            "iter": d.get("iteration"),
            "window s": round(d["window_seconds"], 2),
            "budget s": d["budget_seconds"],
            "result": "PASS" if d["ok"] else "FAIL",
        }
        for name, p in (
            ("fetch", fetch),
            ("verify", phase(d, "verify") or {}),
            ("load", phase(d, "load") or {}),
        ):
            row[f"{name} GB/s"] = round(p["bytes"] / p["seconds"] / 1e9, 3) if p.get("seconds") else None
        row["continued"] = continuation_word(d)
        row["reason"] = "" if d["ok"] else d.get("reason", "")
        rows.append(row)
    return rows


def continuation_word(drill: dict) -> str:
    """What a drill's continuation said: certified, does not resume, not checkable yet, or ''
    (none ran)."""
    found = next((c for c in drill.get("checks", []) if c["name"] == "continuation"), None)
    if found is None:
        return ""
    if drill.get("certified"):
        return "certified"
    return {"fail": "does not resume", "unchecked": "not checkable yet"}.get(found.get("outcome"), "passed")


def trend_png(drills: list[dict]) -> bytes:
    """The restore window per drill and source, with each source's budget, as a PNG."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=100)
    colours = {DrillSource.SHARED: "tab:blue", DrillSource.ARCHIVE: "tab:orange"}
    for source, colour in colours.items():
        points = [(i, d) for i, d in enumerate(drills) if d["source"] == source]
        if not points:
            continue
        ax.plot(
            [i for i, _ in points],
            [d["window_seconds"] for _, d in points],
            "-o",
            color=colour,
            label=f"{source} window",
        )
        failed = [(i, d["window_seconds"]) for i, d in points if not d["ok"]]
        if failed:
            ax.scatter(*zip(*failed), marker="x", s=80, color="red", zorder=3)
        certified = [(i, d["window_seconds"]) for i, d in points if d.get("certified")]
        if certified:
            ax.scatter(*zip(*certified), marker="*", s=140, color="tab:green", zorder=4)
        ax.axhline(
            points[-1][1]["budget_seconds"],
            color=colour,
            linestyle="--",
            linewidth=1,
            label=f"{source} budget",
        )
    ax.set_xticks(
        range(len(drills)), [d["started_at"][5:16].replace("T", "\n") for d in drills], fontsize="x-small"
    )
    ax.set_xlabel("drill start (UTC; x = failed, * = certified: trained on as the original run did)")
    ax.set_ylabel("restore window (s)")
    ax.set_title("restore drills: copy + verify + load")
    ax.legend(loc="upper left", fontsize="small")
    return png(fig)


def continuation_png(drill: dict) -> bytes:
    """The original and the continued run's loss and learning rate over the drill's continued
    iterations, as a PNG."""
    plt = pyplot()

    drawn = drill["continuation_series"]
    iterations = drawn["iteration"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=100)
    for ax, name, label in ((axes[0], "loss", "loss"), (axes[1], "lr", "learning rate")):
        for side, style in (("original", "-"), ("continued", "o")):
            values = [float("nan") if v is None else v for v in drawn[f"{side}_{name}"]]
            ax.plot(iterations, values, style, label=f"{side} run", markersize=6, fillstyle="none")
        ax.set_xlabel("iteration")
        ax.set_ylabel(label)
        ax.legend(fontsize="small")
    fig.suptitle(
        f"continuation from iteration {drill['iteration']} ({continuation_word(drill) or 'not run'})",
        fontsize="medium",
    )
    return png(fig)


def continuation_markdown(drill: dict) -> str:
    lines = [
        f"# continuation drill: {drill['job']}, iteration {drill['iteration']}",
        "",
        markdown_image("loss and learning rate, original and continued", continuation_png(drill)),
        "",
        "| iteration | original loss | continued loss | original lr | continued lr |",
        "|---|---|---|---|---|",
    ]
    drawn = drill["continuation_series"]
    for k, iteration in enumerate(drawn["iteration"]):
        cells = [
            drawn[name][k] for name in ("original_loss", "continued_loss", "original_lr", "continued_lr")
        ]
        lines.append(f"| {iteration} | " + " | ".join("" if v is None else repr(v) for v in cells) + " |")
    return "\n".join(lines) + "\n"


def trend_markdown(job: str, found: History) -> str:
    lines = [
        f"# restore drills: {job}",
        "",
        markdown_image("restore window per drill", trend_png(found.drills)),
        "",
    ]
    if found.predicted:
        lines.append("From the newest complete drills:")
        lines += [f"- {line}" for line in found.estimate_lines()]
    return "\n".join(lines) + "\n"
