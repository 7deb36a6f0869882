"""How results look in a terminal and in a pipe: the CLI's only renderers.

In a terminal a table is a rich table whose long cells fold. Anywhere else (``| cat``, ``| grep``,
a log file) it is plain text: a title line, a header, and one line per row with every value
whole, columns aligned with spaces, so a grep for a value finds its row and awk can split it.
Nothing here imports torch or Prefect: the CLI stays quick to start.
"""

from pathlib import Path

from rich.console import Console
from rich.table import Table

from tasks.checkpoint.manifest import RESUME_WORDS
from tasks.checkpoint.state import State

_COLOURS = {State.VALID: "green", State.INVALID: "red", State.IN_PROGRESS: "yellow"}


def table(
    console: Console,
    title: str,
    columns: list[str],
    rows: list[list[str]],
    styles: list[list[str | None]] | None = None,
) -> None:
    """Print a table: rich in a terminal, plain whole-valued rows otherwise."""
    if not console.is_terminal:
        widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
        console.print(f"# {title}", markup=False, highlight=False)
        for line in [columns, *rows]:
            cells = [cell.ljust(width) for cell, width in zip(line, widths)]
            console.print("  ".join(cells).rstrip(), markup=False, highlight=False, soft_wrap=True)
        return
    rich_table = Table(title=title, title_justify="left")
    for column in columns:
        rich_table.add_column(column, overflow="fold")
    for n, row in enumerate(rows):
        cells = [
            f"[{style}]{cell}[/]" if styles and styles[n][i] else cell.replace("[", r"\[")
            for i, (cell, style) in enumerate(zip(row, styles[n] if styles else [None] * len(row)))
        ]
        rich_table.add_row(*cells)
    console.print(rich_table)


def status(console: Console, save_dir: Path, infos, pointer_problem: str | None = None) -> None:
    """The checkpoints of a save directory; pins and reasons only when something needs them."""
    show_pins = any(i.pins or i.expired_pins for i in infos)
    show_reason = any(i.state is not State.VALID for i in infos)
    show_warnings = any(i.warnings for i in infos)
    columns = ["iteration", "state", "size", "consumed", "verified (UTC)", "promoted"]
    columns += ["pins"] * show_pins + ["reason"] * show_reason + ["warnings"] * show_warnings
    rows, styles = [], []
    for i in infos:
        row = [
            str(i.iteration),
            i.state.value + RESUME_WORDS[i.certified],
            f"{i.size_bytes / 1e6:.1f} MB",
            "" if i.consumed_train_samples is None else str(i.consumed_train_samples),
            (i.verified_at or "").replace("T", " ")[:19],
            "yes" if i.promoted else ("?" if pointer_problem else ""),
        ]
        row += [", ".join(i.pins + [f"{pin}, expired" for pin in i.expired_pins])] * show_pins
        row += ["" if i.state is State.VALID else i.reason] * show_reason
        row += ["; ".join(i.warnings)] * show_warnings
        rows.append(row)
        styles.append([None, _COLOURS.get(i.state)] + [None] * (len(row) - 2))
    table(console, f"checkpoints in {save_dir}", columns, rows, styles)


def drills(console: Console, job: str, rows: list[dict]) -> None:
    """The drill history (``tasks.restore.history.trend_rows``)."""
    columns = [c for c in rows[0] if c != "reason" or any(r["reason"] for r in rows)]
    cells = [["" if row.get(c) is None else str(row.get(c)) for c in columns] for row in rows]
    styles = [
        [("green" if row["result"] == "PASS" else "red") if c == "result" else None for c in columns]
        for row in rows
    ]
    table(console, f"restore drills of {job}", columns, cells, styles)


def incidents(console: Console, job: str, rows: list[dict]) -> None:
    """The incident ledger (``tasks.recovery.report.incident_rows``)."""
    columns = list(rows[0])
    cells = [["" if row.get(c) is None else str(row.get(c)) for c in columns] for row in rows]
    styles = [
        [("green" if row["outcome"] == "completed" else "red") if c == "outcome" else None for c in columns]
        for row in rows
    ]
    table(console, f"incidents of {job}", columns, cells, styles)


def health(console: Console, done) -> None:
    """A health sweep (``tasks.health.sweep.Sweep``): the worst nodes first, then what follows."""
    plan = done.plan
    for r in sorted(done.run.reports, key=lambda r: (-r.verdict.rank, r.node)):
        console.print(f"{r.verdict.value} {r.node}: {r.summary}", markup=False)
    if plan.page:
        console.print(f"PAGE: {plan.page}", markup=False)
    for node, reason in plan.drain:
        console.print(
            f"{'drained' if node in plan.drained else 'drain plan'}: {node}: {reason}", markup=False
        )
    for node, why in plan.held:
        console.print(f"{why}: {node}", markup=False)
    for node, state in done.spares.items():
        console.print(f"spare {node}: {state}", markup=False)
