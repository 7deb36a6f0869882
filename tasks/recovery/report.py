"""The incident ledger as people look at it: table rows and a timeline of each incident's phases."""

import time

from tasks.plots import markdown_image, png, pyplot
from tasks.recovery.ledger import PHASES, Incident


def _when(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) if at else ""


def incident_rows(found: list[Incident]) -> list[dict]:
    rows = []
    for i in found:
        start = i.times.get("first_error") or i.times.get("detected")
        end = i.times.get("validated") or max(i.times.values(), default=start)
        rows.append(
            {
                "incident": i.id,
                "when (UTC)": _when(i.times.get("detected")),
                "class": i.cls or "",
                "suspects": ",".join(i.suspect_nodes),
                "drained": ",".join(i.drained),
                "excluded": ",".join(i.excluded),
                "checkpoint": i.checkpoint,
                "failed at": i.failure_iteration,
                "recomputed": i.recomputed_iterations,
                "GPU-h lost": i.lost_gpu_hours,
                "minutes": round((end - start) / 60, 1) if start and end else None,
                "stop rule": i.stop_rule or "",
                "outcome": i.outcome or "",
                "reason": i.reason or "",
            }
        )
    return rows


def timeline_png(found: list[Incident]) -> bytes:
    """One bar per incident, split into the spans between its phases (seconds from its start)."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(11, 0.6 * max(3, len(found)) + 1.6), dpi=100)
    colours = plt.get_cmap("tab10")
    labelled = set()
    for row, incident in enumerate(found):
        marks = [(p, incident.times[p]) for p in PHASES if incident.times.get(p)]
        marks.sort(key=lambda m: m[1])
        if not marks:
            continue
        origin = marks[0][1]
        for (name, at), (_, until) in zip(marks, marks[1:], strict=False):
            index = PHASES.index(name)
            ax.barh(
                row,
                until - at,
                left=at - origin,
                color=colours(index % 10),
                label=None if name in labelled else name,
            )
            labelled.add(name)
    ax.set_yticks(range(len(found)), [f"{i.id} {i.cls or ''} ({i.outcome})" for i in found])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first phase")
    ax.set_title("recovery phases per incident")
    if labelled:  # beside the bars, never over them
        ax.legend(
            fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="span from", title_fontsize=7
        )
    return png(fig)


def incidents_markdown(job: str, found: list[Incident]) -> str:
    image = markdown_image("recovery phases", timeline_png(found))
    last = found[-1]
    return f"# incidents: {job}\n\n**{last.id}: {last.cls} -> {last.outcome}**: {last.reason}\n\n{image}\n"


def _skip_line(skipped: dict) -> str:
    samples = skipped["samples"]
    where = f"samples {samples[0]}-{samples[1] - 1}" if samples else "samples not known (a batch ramp-up)"
    tokens = f", {skipped['tokens']:,} tokens" if skipped["tokens"] is not None else ""
    return (
        f"- **skip**: iterations {', '.join(map(str, skipped['iterations']))} ({where}{tokens}) are "
        "passed untrained (--iterations-to-skip): the data there reproduced its failure on another GPU"
    )


def plan_markdown(plan) -> str:
    """What the approver reads before deciding."""
    tri, incident = plan.triage, plan.incident
    first = tri.first_error
    lines = [
        f"# recovery of {incident.job}: {tri.cls}",
        "",
        f"- incident: `{incident.id}`; failed job: `{incident.failed_job}`",
        f"- triage: **{tri.cls}** — {tri.reason}",
        f"- first error: `{first.file}:{first.line}`: `{first.text[:300]}`"
        if first
        else "- first error: none found",
        f"- suspect nodes: {', '.join(tri.suspect_nodes) or 'none'}",
        f"- checkpoint: **{plan.checkpoint}** (verified candidates: {', '.join(map(str, plan.choices))})",
        *([f"- **fall back**: {incident.fallback}"] if incident.fallback else []),
        *([_skip_line(incident.skipped)] if incident.skipped else []),
        *_certification_lines(plan),
        *(_reverified_line(r) for r in incident.reverified),
        f"- node health: {incident.health}",
        f"- drained: {', '.join(plan.drained) or 'none'}; excluded: {', '.join(plan.exclude) or 'none'}; "
        f"spares admitted: {', '.join(plan.admitted) or 'none'}",
        f"- relaunch: `{plan.relaunch}`",
        *_fits_lines(plan.fits),
        "",
        "| stop rule | fired | detail |",
        "|---|---|---|",
        *(f"| {r.name} | {'YES' if r.fired else 'no'} | {r.detail} |" for r in plan.rules),
    ]
    return "\n".join(lines)


def _fits_lines(fits) -> list[str]:
    """The relaunch script against the checkpoint, in words: what needs this approval first."""
    if fits is None:
        return []
    approve = [f"  - **needs your approval**: {d.words}" for d in fits.needs_approval]
    rest = [f"  - {d.kind}: {d.words}" for d in fits.differences if d not in fits.needs_approval]
    return [f"- relaunch arguments: {fits.summary()}", *approve, *rest]


def _certification_lines(plan) -> list[str]:
    """Which candidates a continuation drill certified, once any has been drilled so; and the
    certified one to choose instead when the plan's is not."""
    if all(v is None for v in plan.certified.values()):
        return []
    words = {
        True: "certified (its continuation drill went on as the original run did)",
        False: "loads, does not resume (its continuation drill failed)",
        None: "no continuation drill",
    }
    lines = [f"- {c}: {words[plan.certified.get(c)]}" for c in plan.choices]
    certified = [c for c in plan.choices if plan.certified.get(c) is True]
    if plan.certified.get(plan.checkpoint) is not True and certified:
        lines.append(
            f"- **{certified[0]} is certified, {plan.checkpoint} is not**: approve with checkpoint "
            f"{certified[0]} to resume from the one proven to go on"
        )
    return lines


def _reverified_line(found: dict) -> str:
    how = (
        f"every byte, {found['engine']} engine" if found["mode"] == "full" else "its manifest's save identity"
    )
    if found["outcome"] == "pass":
        return f"- re-verified {found['iteration']} ({how}, {found['seconds']:.1f} s): passed"
    return (
        f"- re-verified {found['iteration']} ({how}, {found['seconds']:.1f} s): **FAILED**, now invalid and "
        f"not resumed from: {found['reason']}"
    )
