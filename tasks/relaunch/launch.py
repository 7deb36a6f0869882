"""Starting the job's own batch script from a checkpoint: one contract for a recovery's relaunch
and a continuation drill's run.

- How: bash runs the script on this host, in a session of its own, or ``sbatch`` submits it.
- Working directory: the launcher's own; a ``cd`` in the script moves the job, and the job's
  relative paths are read from where its processes are (``job_directory``).
- Environment: the launcher's, with ``CKPT_STEP`` where the step is passed there, and what the
  caller adds (a relaunch's incident token and job name; a continuation's ``CKPT_LOAD``,
  ``CKPT_SAVE``, ``CKPT_EXIT_INTERVAL`` and ``CKPT_LOG``). ``sbatch`` runs in it and exports it
  whole (``--export=ALL``, the step named there too).
- The step: ``CKPT_STEP=N`` in the environment, ``--ckpt-step N`` after the script, or both
  (``step_passing``: ``recovery.pass_step``; a continuation passes it both ways).
- Iterations to skip (a relaunch past a data failure's window): ``CKPT_ITERATIONS_TO_SKIP="N M"``
  in the environment and ``--iterations-to-skip N M`` after the script, passed the same ways as
  the step; the script hands them to Megatron-LM's ``--iterations-to-skip``.
- Output: one file of the run's own, bash's stdout and stderr, or ``sbatch --output``.
- The printed-arguments watch: Megatron-LM's arguments block read from the run's output as soon
  as it is complete, while the run is still starting (``watch_printed``); the caller judges it
  (``tasks.relaunch.printed``) and stops a run that does not fit, each with its own job control.
"""

import os
import subprocess
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tasks.cluster import process
from tasks.relaunch.printed import PrintedArgs, read_printed_args

# How often the run's output is read for its arguments block while it starts.
_POLL_SECONDS = 0.2


SKIP_ENV = "CKPT_ITERATIONS_TO_SKIP"


def step_passing(
    pass_step: Collection[str], step: int, skip: Sequence[int] = ()
) -> tuple[dict[str, str], list[str]]:
    """The step (and the iterations to skip, if any) as the script receives them: ``CKPT_STEP``
    and ``CKPT_ITERATIONS_TO_SKIP`` in its environment (``env``), and ``--ckpt-step N`` and
    ``--iterations-to-skip N ...`` after it (``arg``)."""
    env = {"CKPT_STEP": str(step)} if "env" in pass_step else {}
    args = ["--ckpt-step", str(step)] if "arg" in pass_step else []
    if skip and "env" in pass_step:
        env[SKIP_ENV] = " ".join(map(str, skip))
    if skip and "arg" in pass_step:
        args += ["--iterations-to-skip", *map(str, skip)]
    return env, args


@dataclass(frozen=True)
class Launch:
    """One start of the job's batch ``script`` from checkpoint ``step``, passed as ``pass_step``
    says, with ``env`` added to the launcher's environment."""

    script: Path
    step: int
    pass_step: Collection[str]
    env: Mapping[str, str] = field(default_factory=dict)
    skip: tuple[int, ...] = ()  # iterations Megatron-LM is to pass without training them

    def environ(self) -> dict[str, str]:
        """The environment the script runs in (and the one its flags are read in beforehand)."""
        step_env, _ = step_passing(self.pass_step, self.step, self.skip)
        return {**os.environ, **step_env, **self.env}

    def argv(self) -> list[str]:
        """The script and the step (and iterations to skip) after it, where passed there."""
        _, args = step_passing(self.pass_step, self.step, self.skip)
        return [str(self.script), *args]

    def start(self, output: Path) -> subprocess.Popen:
        """bash runs the script here, in a session of its own, its output and errors into
        ``output``; nothing waits for it unless the caller does."""
        return process.start(["bash", *self.argv()], output, self.environ())

    def sbatch_arguments(self, options: list[str], output: Path) -> list[str]:
        """What follows ``sbatch --parsable`` (run in ``environ()``): ``options``, the job's
        output file (sbatch expands ``%x`` and ``%j``), its environment exported whole with the
        step where it is passed there, the script and the step after it."""
        step_env, _ = step_passing(self.pass_step, self.step, self.skip)
        export = ",".join(["ALL", *(f"{k}={v}" for k, v in step_env.items())])
        return [*options, f"--output={output}", f"--export={export}", *self.argv()]


def job_directory(pid: int) -> Path | None:
    """Where the job started under process ``pid`` opens relative paths: the working directory of
    the Python processes it runs (a ``cd`` in the script moves them) when they all have the same
    one, or, before any has started, that of the script's own process; None when that cannot be
    told (the process is gone, or its Python processes disagree)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    found = set()
    for each in tree:
        try:
            if "python" in " ".join(each.cmdline()[:2]):
                found.add(Path(each.cwd()))
        except psutil.Error:
            continue
    if found:
        return found.pop() if len(found) == 1 else None
    try:
        return Path(root.cwd())
    except psutil.Error:
        return None


def _printed(logs: Sequence[Path], start: int) -> PrintedArgs | None:
    return next(filter(None, (read_printed_args(log, start) for log in logs)), None)


def watch_printed(
    logs: Sequence[Path], deadline_s: float, starting: Callable[[], bool], start: int = 0
) -> PrintedArgs | None:
    """Megatron-LM's arguments block from the first of ``logs`` (the run's output files, each
    from byte ``start``) that holds it complete, as soon as one does; None when the run is past
    its start (``starting()`` false: it ended, or trained without printing the block there) or
    ``deadline_s`` seconds pass without it. The logs are read once more after ``starting()``
    turns false: the run may have printed the block and ended."""
    deadline = time.monotonic() + deadline_s
    while True:
        found = _printed(logs, start)
        if found is not None:
            return found
        if not starting():
            return _printed(logs, start)
        if time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_SECONDS)
