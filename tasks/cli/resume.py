"""``ckptops validate-resume``: did the resumed run pick up where the failed one left off."""

import json
from pathlib import Path
from typing import Annotated

import typer

from tasks.cli.common import JsonOpt, ProfileOpt, expected_errors, out
from tasks.profile import load_profile

commands = typer.Typer()


@commands.command("validate-resume")
def validate_resume_command(
    after: Annotated[
        Path, typer.Option("--after", help="step records or Megatron-LM log of the resumed run")
    ],
    before: Annotated[
        Path | None,
        typer.Option(
            "--before", help="records or log of the run before the failure [default: the stored baseline]"
        ),
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="the checkpoint the run resumed from (iter_NNNNNNN) [default: the promoted one]",
        ),
    ] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Check a resumed run against the run before the failure: exit 0 validated, 1 rejected."""
    with expected_errors():
        from tasks.resume.validate import validate

        result = validate(load_profile(profile), after, before, checkpoint)
    if as_json:
        out.print_json(json.dumps(result.to_dict()))
    else:
        out.print(result.line(), markup=False)
        for check in result.checks:
            said = [f"expected {check.expected}; observed {check.observed}"] if check.expected else []
            said += [check.detail] if check.detail else []
            text = "; ".join(said) or ("checked" if check.ok else "no reason recorded")
            out.print(f"  {check.outcome:<9} {check.name}: {text}", markup=False)
    raise typer.Exit(0 if result.ok else 1)
