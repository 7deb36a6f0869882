"""``ckptops``: the command line for humans and scripts. It calls the same task code as the flows.

Exit codes: 0 success (for ``verify``: valid), 1 the thing checked is not good (invalid, in
progress, a failed step), 2 bad usage or unreadable input. An expected failure prints one line
naming the file and the check, never a traceback.

One module per command group; each command parses its arguments, calls one function of its
domain and renders what it returns.
"""

import logging
import sys

import typer

from tasks.cli import archive, checkpoints, goodput, health, profile, recovery, resume

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Verify, promote and keep training checkpoints you can trust.",
)
# Merged in this order, which is the order --help lists them in.
for group in (checkpoints, archive, resume, recovery):
    app.add_typer(group.commands)
app.add_typer(goodput.commands, name="goodput")
app.add_typer(health.commands, name="health")
app.add_typer(profile.commands, name="profile")


def main() -> None:
    # The warnings of tasks/ (a record skipped in a history file, a pin not ours) on stderr, one
    # line each, marked as ckptops's.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ckptops: warning: %(message)s"))
    handler.setLevel(logging.WARNING)
    logging.getLogger("tasks").addHandler(handler)
    # Typer exits 2 on usage errors, like the rest of our input errors.
    sys.exit(app())
