"""``ckptops verify | promote | status | retain | pin | unpin | next-batch``: the checkpoints of
one save directory, their verification, the pointer to the one to resume from, what is kept, and
the batch a resume from one trains on next."""

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from tasks import render
from tasks.cli.common import ANY_SAVE_DIR, JsonOpt, ProfileOpt, byte_progress, err, expected_errors, out, warn
from tasks.errors import Malformed, UsageError
from tasks.profile import Profile, load_profile

commands = typer.Typer()


def _shard_lines(statuses, events: list[str]) -> None:
    """The Slurm engine's news, one line each on stderr (with --json too: stdout stays JSON): a
    shard done (where, how fast), failed, or retried elsewhere."""
    for line in events:
        err.print(line, markup=False, highlight=False)


def _dir_bytes(path: Path) -> int:
    from tasks.storage.local import list_files

    return sum(st.st_size for st in list_files(path).values())


def _save_dir(profile: Profile, given: Path | None) -> Path:
    return (given or profile.job.save_dir).resolve()


def _options(profile: Profile, save_dir: Path, **overrides):
    """The profile's options for ``save_dir``; where the profile signs its own manifests and this
    is another save directory, a warning says that its signatures go unchecked."""
    from tasks.checkpoint.state import VerifyOptions

    options = VerifyOptions.from_profile(profile, save_dir, **overrides)
    _say_if_unchecked(profile, save_dir, options.trust)
    return options


def _say_if_unchecked(profile: Profile, save_dir: Path, trust) -> None:
    """Where the profile signs its own manifests and ``save_dir`` is another job's, a warning that
    its signatures go unchecked (the profile speaks for its own job only)."""
    if profile.sign is not None and not trust.checks:
        warn(f"{save_dir}: not {profile.job.name}'s save directory: {trust.describe()}")


@commands.command()
def verify(
    path: Annotated[Path, typer.Argument(help="a checkpoint directory, iter_NNNNNNN")],
    as_json: JsonOpt = False,
    profile: ProfileOpt = None,
    read_only: Annotated[bool, typer.Option("--read-only", help="do not write manifest.json")] = False,
    engine: Annotated[
        str | None,
        typer.Option("--engine", help="local: read here; slurm: shards over nodes (default: the profile's)"),
    ] = None,
    nodes: Annotated[
        int | None, typer.Option("--nodes", min=1, help="nodes for the slurm engine (default: the profile's)")
    ] = None,
):
    """Verify one checkpoint: exit 0 valid, 1 invalid or still in progress, 2 unreadable input."""
    with expected_errors():
        from tasks.checkpoint.signing import Trust
        from tasks.checkpoint.verify import checkpoint_path, verify_with_profile

        prof = load_profile(profile)
        directory = checkpoint_path(path)
        _say_if_unchecked(prof, directory.parent, Trust.of(prof, directory.parent))
        with byte_progress(f"verify {path.name}", _dir_bytes(directory), not as_json) as progress:
            result = verify_with_profile(prof, directory, read_only, engine, nodes, progress, _shard_lines)
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "directory": str(result.directory),
                    "iteration": result.iteration,
                    "state": result.state.value,
                    "reason": result.reason,
                    "bytes_read": result.bytes_read,
                    "seconds": round(result.seconds, 3),
                    "checks": [asdict(c) for c in result.checks],
                    "shards": result.shards,
                    "signed_by": result.signed_by,
                    "tensors": result.manifest.tensors if result.manifest else None,
                }
            )
        )
    else:
        stats = (
            f" ({result.bytes_read / 1e6:.1f} MB in {result.seconds:.2f}s, {result.throughput_gbps:.2f} GB/s)"
        )
        signed = f"; manifest signed by {result.signed_by}" if result.signed_by else ""
        out.print(result.line() + (stats if result.ok else "") + signed, markup=False)
    raise typer.Exit(0 if result.ok else 1)


@commands.command()
def promote(
    save_dir: Annotated[Path | None, typer.Argument(help=ANY_SAVE_DIR)] = None,
    iteration: Annotated[
        int | None,
        typer.Option(
            "--iteration", "-i", min=0, help="promote this iteration (verified valid) instead of the newest"
        ),
    ] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Verify new complete checkpoints, oldest first, and point to the newest that passed (or to N)."""
    with expected_errors():
        from tasks.checkpoint.promote import promote as run_promote

        prof = load_profile(profile)
        directory = _save_dir(prof, save_dir)
        options = _options(prof, directory)

        def report(result):
            if not as_json:
                out.print(result.line(), markup=False)

        report_ = run_promote(
            directory, options, prof.verify.lock_timeout_seconds, iteration, on_verified=report
        )
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "previous": report_.previous,
                    "current": report_.current,
                    "changed": report_.changed,
                    "message": report_.message,
                    "refused": report_.refused,
                    "verified": [
                        {"iteration": v.iteration, "state": v.state.value, "reason": v.reason}
                        for v in report_.verifications
                    ],
                }
            )
        )
    else:
        name = lambda i: "none" if i is None else str(i)  # noqa: E731
        arrow = (
            f"{name(report_.previous)} -> {name(report_.current)}"
            if report_.changed
            else f"stays at {name(report_.current)}"
        )
        out.print(f"latest verified: {arrow} ({report_.message})", markup=False)
    for line in report_.refused:
        err.print(f"ckptops: not promoted: {line}", markup=False, highlight=False)
    if report_.cleared:
        err.print(f"ckptops: {directory}: pointer removed, no valid checkpoint to resume from", markup=False)
    raise typer.Exit(0 if report_.ok else 1)


@commands.command()
def status(
    save_dir: Annotated[Path | None, typer.Argument(help=ANY_SAVE_DIR)] = None,
    log: Annotated[
        Path | None,
        typer.Option("--log", help="the job's Megatron-LM log [default: recovery.step_records, if a log]"),
    ] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Every checkpoint and its promotion, the saves not complete and the store's space; ALERT
    (exit 1) for a save stalled or failed, a tracker (Megatron-LM's or Megatron-Bridge's) naming
    a checkpoint missing, invalid or not verified past verify.abandon_after_seconds, no room for
    the next save, or a checkpoint waiting past verify.alert_after_seconds unpromoted."""
    with expected_errors():
        from tasks.status import job_status

        prof = load_profile(profile)
        directory = _save_dir(prof, save_dir)
        found = job_status(prof, directory, _options(prof, directory), details=not as_json, log=log)
    alarms = found.alarms
    if as_json:
        saves = {s.iteration: s.to_dict() for s in found.saves.saves}
        rows = [i.to_dict() | {"save": saves.get(i.iteration)} for i in found.checkpoints]
        out.print_json(json.dumps(rows))
    else:
        render.status(out, directory, found.checkpoints, found.pointer_problem)
        for save in found.saves.saves:
            if save.state != "complete" and not save.alarming:
                out.print(save.line(), markup=False)
        out.print(found.saves.space.line(), markup=False)
    for line in alarms:
        (err if as_json else out).print(line, markup=False)
    if found.overdue is not None:
        (err if as_json else out).print(found.overdue.line(), markup=False)
    for line in found.archive:
        out.print(line, markup=False)
    for path, why in found.stale_scratch:
        out.print(f"stale drill scratch: {path} ({why}); the next drill removes it", markup=False)
    for path, why in found.foreign_scratch:
        out.print(f"not a drill's scratch: {path} ({why}); ckptops leaves it alone", markup=False)
    for line in found.problems:
        err.print(f"ckptops: {line}", markup=False)
    if found.problems:
        raise typer.Exit(Malformed.exit_code)
    if found.overdue is not None or alarms:
        raise typer.Exit(1)


@commands.command()
def retain(
    save_dir: Annotated[Path | None, typer.Argument(help=ANY_SAVE_DIR)] = None,
    keep: Annotated[
        int | None, typer.Option("--keep", help="verified checkpoints to keep [default: the profile's]")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="show the plan, delete nothing")] = False,
    profile: ProfileOpt = None,
):
    """Delete verified checkpoints older than the newest K (never the promoted, newer or pinned)."""
    with expected_errors():
        from tasks.checkpoint.retention import retain as run_retain

        prof = load_profile(profile)
        directory = _save_dir(prof, save_dir)
        keep_verified = keep if keep is not None else prof.retention.keep_verified
        if keep_verified < 2:
            raise UsageError("--keep: at least 2 (the newest may still be in use)")
        plan, deleted = run_retain(
            directory, _options(prof, directory), keep_verified, prof.verify.lock_timeout_seconds, dry_run
        )
    verb = "would delete" if dry_run else "deleted"
    targets = plan.delete if dry_run else deleted
    out.print(f"{verb}: {', '.join(map(str, targets)) or 'nothing'}", markup=False)
    for iteration, why in sorted(plan.kept.items()):
        out.print(f"kept {iteration}: {why}", markup=False)
    if plan.invalid:
        err.print(f"ckptops: failed checkpoints kept for inspection: {', '.join(map(str, plan.invalid))}")


@commands.command()
def pin(
    iteration: Annotated[int, typer.Argument(min=0)],
    reason: Annotated[str, typer.Option("--reason", help="why it must be kept")],
    save_dir: Annotated[Path | None, typer.Option("--save-dir")] = None,
    holder: Annotated[str, typer.Option("--holder")] = "operator",
    profile: ProfileOpt = None,
):
    """Keep a checkpoint whatever retention says."""
    with expected_errors():
        from tasks.checkpoint.layout import iter_dir_name
        from tasks.checkpoint.pins import pin as do_pin

        directory = _save_dir(load_profile(profile), save_dir)
        if directory.is_dir() and not (directory / iter_dir_name(iteration)).is_dir():
            raise UsageError(f"{directory / iter_dir_name(iteration)}: no such checkpoint to pin")
        path = do_pin(directory, iteration, holder, reason)
    out.print(f"pinned {iteration} ({path.name})", markup=False)


@commands.command()
def unpin(
    iteration: Annotated[int, typer.Argument()],
    save_dir: Annotated[Path | None, typer.Option("--save-dir")] = None,
    holder: Annotated[str, typer.Option("--holder")] = "operator",
    profile: ProfileOpt = None,
):
    """Remove a pin."""
    with expected_errors():
        from tasks.checkpoint.pins import unpin as do_unpin

        removed = do_unpin(_save_dir(load_profile(profile), save_dir), iteration, holder)
    out.print(f"{'unpinned' if removed else 'was not pinned by ' + holder}: {iteration}", markup=False)
    raise typer.Exit(0 if removed else 1)


@commands.command("next-batch")
def next_batch(
    path: Annotated[Path, typer.Argument(help="a checkpoint directory, iter_NNNNNNN")],
    cache: Annotated[
        Path | None,
        typer.Option("--data-cache-path", help="the dataset's index cache (default: the job's own)"),
    ] = None,
    as_json: JsonOpt = False,
):
    """The global batch a run resumed from this checkpoint trains on first: each sample's place in
    the data order and its documents, from the dataset's index files alone (GPTDataset)."""
    with expected_errors():
        from tasks.checkpoint.batches import next_batch as compute

        batch = compute(path, cache)
    if as_json:
        out.print_json(json.dumps(batch.to_dict()))
        return
    rows = [
        [str(s.position), str(s.sample), " ".join(map(str, s.documents)), f"{s.first_offset}..{s.end_offset}"]
        for s in batch.samples
    ]
    render.table(
        out,
        f"iteration {batch.iteration}: the next {batch.global_batch_size} samples after {batch.consumed} "
        f"({Path(batch.description).name.removesuffix('-description.txt')})",
        ["position", "sample", "documents", "tokens (first..last document)"],
        rows,
    )
