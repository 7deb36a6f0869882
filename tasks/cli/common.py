"""What every command group of the CLI shares: the two consoles, the shared options, and the one
way an expected failure ends a command (one line on stderr, the error's exit code)."""

from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

from tasks.errors import CkptopsError, Unreadable, UsageError, unreadable
from tasks.profile import Profile, load_profile

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

ProfileOpt = Annotated[
    str | None,
    typer.Option("--profile", "-p", help="profile name in profiles/ or a YAML path [default: local]"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the result as JSON")]
# Promotion, status and retention work on any save directory (another job's is judged with the
# profile's verify and retention settings, none of its job's: name, layout, integrity.json);
# archive and drills carry one job's settings (bucket, budget, layout) and refuse another's.
ANY_SAVE_DIR = (
    "a save directory (default: the profile's); another job's is judged by the profile's verify and "
    "retention settings, not its job settings"
)
OWN_SAVE_DIR = "the profile's own save directory (the default); any other is refused"


def warn(line: str) -> None:
    err.print(f"ckptops: warning: {line}", markup=False)


def fail(error: CkptopsError) -> None:
    err.print(f"ckptops: {error}", markup=False)
    raise typer.Exit(error.exit_code)


@contextmanager
def expected_errors():
    import httpx

    try:
        yield
    except CkptopsError as e:
        fail(e)
    except httpx.HTTPStatusError as e:  # from the Prefect server (Prefect's own errors subclass it)
        if e.response.status_code != 401:
            raise
        fail(
            UsageError(
                f"PREFECT_API_AUTH_STRING: the Prefect server at {e.request.url.scheme}://{e.request.url.host}:"
                f"{e.request.url.port} refused the credentials (401)"
            )
        )
    except httpx.ConnectError as e:
        fail(UsageError(f"PREFECT_API_URL: no Prefect server answers ({e})"))
    except OSError as e:
        # Whatever the environment refused (a read-only directory, a full disk, EIO) is not a
        # verdict on a checkpoint: name the path and exit 2, like any unreadable input.
        fail(unreadable(e.filename, e) if e.filename else Unreadable(e.strerror or str(e)))


@contextmanager
def byte_progress(description: str, total: int, enabled: bool):
    """A progress bar on stderr for long reads; nothing when piped or asked for JSON."""
    if not enabled or not err.is_terminal:
        yield None
        return
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def profile_for(profile: str | None, save_dir: Path | None) -> Profile:
    """The profile, checked to describe ``save_dir`` when one is given: archive, drill and
    incident settings belong to one job, and must not be applied to another job's directory."""
    prof = load_profile(profile)
    if save_dir is not None and save_dir.resolve() != prof.job.save_dir.resolve():
        raise UsageError(f"{save_dir}: not the save directory of profile {prof.source} ({prof.job.save_dir})")
    return prof
