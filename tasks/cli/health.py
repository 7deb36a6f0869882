"""``ckptops health run | classify | history | burn-in | fleet``: node health checks across the
cluster, the verdict on one saved tool output, a node's record (its verdicts and the incidents
naming it), the return of drained nodes through a burn-in, and the fleet at a glance."""

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from tasks import render
from tasks.cli.common import JsonOpt, ProfileOpt, err, expected_errors, out
from tasks.errors import UsageError
from tasks.profile import Nccl, Pairs, load_profile

commands = typer.Typer(no_args_is_help=True, help="Node health: DCGM, GPU basics, nccl-tests.")


@commands.command("run")
def health_run(
    profile: ProfileOpt = None,
    nodes: Annotated[
        str | None, typer.Option("--nodes", help="comma-separated node names [default: the profile's]")
    ] = None,
    level: Annotated[
        int | None, typer.Option("--level", min=1, max=4, help="DCGM diag level [default: the profile's]")
    ] = None,
    admit: Annotated[
        bool, typer.Option("--admit", help="run the spare admission set (r3, NCCL, pair test)")
    ] = False,
    as_json: JsonOpt = False,
):
    """Check nodes in parallel; print a verdict per node; drain (or plan drains) as the profile says."""
    with expected_errors():
        from tasks.health.sweep import sweep

        prof = load_profile(profile)
        if prof.health is None:
            raise UsageError(f"{prof.source}: no health section")
        done = sweep(
            prof.health,
            nodes.split(",") if nodes else None,
            level,
            admit,
            progress=None if as_json else lambda r: err.print(f"  {r.node}: {r.verdict.value}", markup=False),
        )
    if as_json:
        plan = done.plan
        out.print_json(
            json.dumps(
                {
                    "nodes": [r.to_dict() for r in done.run.reports],
                    "drain": plan.drain,
                    "drained": plan.drained,
                    "held": plan.held,
                    "rerun": plan.rerun,
                    "page": plan.page,
                    "spares": done.spares,
                    "nvrx_segments": asdict(done.segments) if done.segments else None,
                }
            )
        )
    else:
        render.health(out, done)
        if done.segments and done.segments.message():
            out.print(done.segments.message(), markup=False)
    raise typer.Exit(done.exit_code)


@commands.command("classify")
def health_classify(
    tool: Annotated[str, typer.Argument(help="dcgm or nccl")],
    file: Annotated[Path, typer.Argument(help="a saved raw output")],
    exit_code: Annotated[
        int | None, typer.Option("--exit-code", help="the tool's exit code, if known")
    ] = None,
    level: Annotated[
        int | None, typer.Option("--level", help="dcgm: the level it ran at (checks the test set)")
    ] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Classify one saved dcgmi diag or all_reduce_perf output; the verdict word comes first.

    nccl: the busbw gates are the profile's (health.nccl for one node, health.pairs for several,
    told apart by the host names in the output's rank table; a profile without a health section
    has the schema's defaults)."""
    with expected_errors():
        from tasks.health.classify import classify_file
        from tasks.health.nccl import Gates

        health = load_profile(profile).health
        nccl, pairs = (health.nccl, health.pairs) if health else (Nccl(), Pairs())
        check = classify_file(tool, file, exit_code, level, Gates.from_settings(nccl, pairs))
    if as_json:
        out.print_json(json.dumps(check.to_dict()))
    else:
        out.print(f"{check.verdict.value} {check.detail}", markup=False)
        for item in check.evidence[1:]:
            out.print(f"  {item.detail}", markup=False)
    raise typer.Exit(check.verdict.exit_code)


@commands.command("history")
def health_history(
    node: Annotated[str, typer.Argument(help="the node's name, as the profile names it")],
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """A node's record: every health verdict on it and every incident that named it a suspect,
    oldest first, then whether the repeat-suspect rule (health.suspect) drains it."""
    with expected_errors():
        from tasks.cluster.transport import check_node_name
        from tasks.health.history import describe, read_history, standing

        prof = load_profile(profile)
        if prof.health is None:
            raise UsageError(f"{prof.source}: no health section")
        node = check_node_name(node)
        entries = read_history(prof.health.raw_dir, node)
        found = standing(node, entries, prof.health.suspect)
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "node": node,
                    "entries": entries,
                    "counted_incidents": [e.get("incident") for e in found.counted],
                    "repeat_suspect": found.repeat_suspect,
                }
            )
        )
    else:
        if not entries:
            out.print(f"{node}: no history in {prof.health.raw_dir}", markup=False)
        for entry in entries:
            out.print(describe(entry), markup=False)
        out.print(found.line(), markup=False)


def _health(profile):
    prof = load_profile(profile)
    if prof.health is None:
        raise UsageError(f"{prof.source}: no health section")
    return prof


@commands.command("burn-in")
def health_burn_in(
    nodes: Annotated[
        list[str] | None, typer.Argument(help="only these nodes [default: every node ckptops drained]")
    ] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Burn in the nodes ckptops drained and return those that pass to service (never one drained
    by someone else or held for another reason); exit 0, or 1 when a node failed or is held for a person."""
    with expected_errors():
        from tasks.cluster.transport import check_node_name
        from tasks.health.burn_in import burn_in

        prof = _health(profile)
        done = burn_in(prof.health, [check_node_name(n) for n in nodes or []] or None)
    if as_json:
        exclusions = asdict(done.exclusions) if done.exclusions else None
        out.print_json(
            json.dumps({"nodes": [o.to_dict() for o in done.outcomes], "nvrx_exclusions": exclusions})
        )
    else:
        for outcome in done.outcomes:
            out.print(outcome.line(), markup=False)
        if not done.outcomes:
            out.print("no node drained by ckptops is held out of service", markup=False)
        if done.exclusions and done.exclusions.message():
            out.print(done.exclusions.message(), markup=False)
    raise typer.Exit(done.exit_code)


@commands.command("fleet")
def health_fleet(profile: ProfileOpt = None, as_json: JsonOpt = False):
    """The fleet at a glance: each node healthy, drained (by ckptops, with reason and since when, or
    by someone else), in burn-in, held for a person or returned; spares ready, in use or out of
    service; exit 1 when fewer spares are ready than health.burn_in.min_ready_spares."""
    with expected_errors():
        from tasks.health.accounting import fleet

        found = fleet(_health(profile).health)
    if as_json:
        out.print_json(json.dumps(found.to_dict()))
    else:
        for n in found.nodes:
            out.print(f"{n.node:<16} {n.state:<6} {n.place:<24} {n.detail}".rstrip(), markup=False)
        out.print(found.summary(), markup=False)
    if found.spares_short:
        err.print(f"ckptops: {found.spares_short}", markup=False)
    raise typer.Exit(1 if found.spares_short else 0)
