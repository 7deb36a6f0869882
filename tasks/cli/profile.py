"""``ckptops profile init | check``: a starting profile for a team's existing job, read off its
save directory and batch script; a profile checked against this machine."""

from pathlib import Path
from typing import Annotated

import typer

from tasks.cli.common import JsonOpt, ProfileOpt, expected_errors, out
from tasks.errors import UsageError

commands = typer.Typer(help="Bring a job in: a starting profile, and a profile checked against this machine.")


@commands.command("init")
def profile_init(
    save_dir: Annotated[Path, typer.Option("--save-dir", help="the job's --save directory")],
    script: Annotated[
        Path | None, typer.Option("--script", help="the job's batch script (its relaunch)")
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="the job's name [default: the folder's]")] = None,
    launcher: Annotated[
        str | None,
        typer.Option("--launcher", help="slurm or local [default: slurm when the script has #SBATCH lines]"),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--out", help="write it here (never over a file) [default: stdout]")
    ] = None,
):
    """A starting profile: the job's layout from its newest checkpoint's saved args, its launcher
    from its script, each section left out named with what it would enable; every value quoted,
    so it loads back as given."""
    with expected_errors():
        from tasks.adopt import starting_profile

        if launcher not in (None, "slurm", "local"):
            raise UsageError(f"--launcher {launcher}: slurm or local")
        text = starting_profile(save_dir, script, name, launcher)
        if output is None:
            out.print(text, markup=False, end="", soft_wrap=True)
            return
        try:
            with open(output, "x", encoding="utf-8") as f:
                f.write(text)
        except FileExistsError:
            raise UsageError(f"{output}: exists; not overwritten") from None
        out.print(f"wrote {output}; next: ckptops profile check -p {output}", markup=False)


@commands.command("check")
def profile_check(profile: ProfileOpt = None, as_json: JsonOpt = False):
    """The profile against this machine: every path it names (and the job's name) read as its
    line says, each path there, the launcher's tools, the job script's relaunch and continuation
    lines, and what each missing section would enable. Exit 1 when something it names is wrong."""
    with expected_errors():
        import json

        from tasks.adopt import check_profile
        from tasks.profile import load_profile

        prof = load_profile(profile)
        checks = check_profile(prof)
    if as_json:
        out.print_json(json.dumps({"profile": str(prof.source), "checks": [c.to_dict() for c in checks]}))
    else:
        out.print(f"profile {prof.source} (job {prof.job.name})", markup=False)
        for check in checks:
            out.print(f"  {check.outcome:<9} {check.name}: {check.detail}", markup=False)
    raise typer.Exit(1 if any(c.failed for c in checks) else 0)
