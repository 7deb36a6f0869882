"""Bringing a team's existing job in: a starting profile read off its save directory and batch
script (``ckptops profile init``), and a profile checked against this machine (``ckptops profile
check``): every path it names read as its line says, the launcher's tools, the script's relaunch
and continuation lines, and what each section it lacks would enable.

The starting profile is written line by line, to keep a comment on each key and on each section
left to fill in, but every value in it is written by YAML's own emitter, double-quoted on one line
(``_yaml``): a save directory ``job #1``, a script ``run: 2.sh``, spaces at either end, a line
break or any other character load back as given, and no comment can be broken out of. The job's
name must be a profile's (lowercase letters, digits and ``-``), or init refuses it.
"""

import math
import os
import re
import shutil
from pathlib import Path

import yaml

from tasks.checkpoint import layout
from tasks.checkpoint.signing import Trust
from tasks.errors import CkptopsError, Malformed, UsageError
from tasks.job import step_records
from tasks.outcome import Check, Outcome
from tasks.profile import SLUG_PATTERN, unquoted_values_cut_short
from tasks.storage.bounded import read_bounded

# What each optional section of a profile makes possible.
ENABLES = {
    "recovery": "ckptops recover and the recovery-run flow: triage, relaunch, watch and validation",
    "drill": "ckptops drill and the restore drills from the shared store and the archive",
    "archive": "ckptops archive, the archive copy and the drill from the archive",
    "health": "ckptops health run and the node-health flow (DCGM, nccl-tests, drains)",
    "resume": "the windows and tolerances of validate-resume (the defaults apply without it)",
    "sign": "signed manifests: who may vouch for a checkpoint's bytes (unset: manifests unsigned)",
}
_SLURM_TOOLS = ("sbatch", "scontrol", "squeue", "scancel")

# A batch script is a page or two; a file past this is not one, and is not read whole.
MAX_SCRIPT_BYTES = 4 << 20


def _check(name: str, ok: bool | None, detail: str, file: Path | None = None) -> Check:
    outcome = Outcome.UNCHECKED if ok is None else Outcome.PASS if ok else Outcome.FAIL
    return Check(name, outcome, detail, file=str(file) if file else None)


def newest_checkpoint(save_dir: Path) -> Path | None:
    found = layout.list_iterations(save_dir) if save_dir.is_dir() else []
    return save_dir / layout.iter_dir_name(max(found)) if found else None


def saved_layout(checkpoint: Path) -> dict[str, int]:
    """TP, PP and DP as the checkpoint's saved args say (DP from the world size); a checkpoint
    file that cannot be read is one ``Malformed`` line naming the checkpoint's folder."""
    from tasks.checkpoint.dcp import CheckFailed
    from tasks.checkpoint.facts import saved_args

    try:
        args, _ = saved_args(checkpoint)
    except CheckFailed as e:
        raise Malformed(f"{checkpoint}: {e}") from None
    try:
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        world = int(getattr(args, "world_size", tp * pp) or tp * pp)
    except (TypeError, ValueError) as e:
        raise Malformed(f"{checkpoint}: its saved args hold no layout ({e})") from None
    if min(tp, pp, world) < 1:
        raise Malformed(f"{checkpoint}: its saved args say TP {tp}, PP {pp}, world size {world}")
    return {"tensor_parallel": tp, "pipeline_parallel": pp, "data_parallel": max(1, world // (tp * pp))}


def _save_dir(profile) -> list[Check]:
    save_dir = profile.job.save_dir
    if not save_dir.is_dir():
        return [_check("job.save_dir", False, f"{save_dir}: no such directory", save_dir)]
    newest = newest_checkpoint(save_dir)
    if newest is None:
        return [_check("job.save_dir", None, f"{save_dir}: no iter_* checkpoint yet: nothing to compare")]
    found = [_check("job.save_dir", True, f"{save_dir}: {len(layout.list_iterations(save_dir))} checkpoints")]
    try:
        saved = saved_layout(newest)
    except CkptopsError as e:
        return [*found, _check("job.layout", None, f"{newest.name}: its args cannot be read: {e}")]
    said = profile.job.layout.model_dump()
    differ = [f"{k} {said[k]} (the checkpoint: {v})" for k, v in saved.items() if said[k] != v]
    found.append(
        _check(
            "job.layout",
            not differ,
            f"against {newest.name}'s saved args: " + ("; ".join(differ) if differ else "the same"),
        )
    )
    return found


def _read(script: Path) -> str:
    """A batch script's text: a regular file of at most ``MAX_SCRIPT_BYTES`` (a FIFO would block
    the reader), refused in one line naming it."""
    return read_bounded(script, MAX_SCRIPT_BYTES, "the batch script").decode(errors="replace")


def _script(name: str, script: Path, needs: tuple[str, ...]) -> Check:
    try:
        text = _read(script)
    except (OSError, CkptopsError) as e:
        return _check(name, False, f"{script}: {e}", script)
    missing = [n for n in needs if n not in text]
    if missing:
        return _check(name, False, f"{script}: does not use {', '.join(missing)}", script)
    return _check(name, True, f"{script}: uses {', '.join(needs)}")


def _skips(script: Path, pass_step) -> Check:
    """Whether a relaunch past a data failure can reach Megatron-LM's --iterations-to-skip: the
    script reads CKPT_ITERATIONS_TO_SKIP, or hands its own arguments on ("$@") where they are
    passed. Said, not failed: the relaunch's printed arguments are the authority."""
    from tasks.relaunch.launch import SKIP_ENV

    try:
        text = _read(script)
    except (OSError, CkptopsError) as e:
        return _check("recovery.skip_bad_data", False, f"{script}: {e}", script)
    if SKIP_ENV in text or ("arg" in pass_step and '"$@"' in text):
        return _check("recovery.skip_bad_data", True, f"{script}: a data failure's skip reaches it")
    return Check(
        "recovery.skip_bad_data",
        Outcome.WARN,
        f"{script}: reads no {SKIP_ENV}"
        + (' and hands on no "$@"' if "arg" in pass_step else "")
        + ": a relaunch past a data failure would be stopped before it trains (or set "
        "recovery.skip_bad_data: never)",
        file=str(script),
    )


def _recovery(profile) -> list[Check]:
    from tasks.relaunch.precheck import REQUIRED_FLAG

    settings = profile.recovery
    found = [_script("recovery.script", settings.script, (REQUIRED_FLAG,))]
    if settings.skip_bad_data != "never":
        found.append(_skips(settings.script, settings.pass_step))
    tools = _SLURM_TOOLS if settings.launcher == "slurm" else ("bash",)
    absent = [t for t in tools if shutil.which(t) is None]
    found.append(
        _check(
            "recovery.launcher",
            not absent,
            f"{settings.launcher}: "
            + (f"{', '.join(absent)} not on PATH" if absent else "its tools are here"),
        )
    )
    records = step_records.configured(profile)
    if records is None:
        found.append(
            _check(
                "recovery.step_records",
                True,
                "not set: the failed run's steps come from its logs, the relaunch's from its own output",
            )
        )
    else:
        found.append(_check("recovery.step_records", records.is_file(), f"{records}: the job's step records"))
    log_dir = settings.log_dir or profile.job.save_dir.parent / "logs"
    found.append(
        _check("recovery.log_dir", _writable(log_dir), f"{log_dir}: the relaunch's output goes here")
    )
    return found


def _writable(folder: Path) -> bool:
    """Whether ``folder`` is, or could be made, a folder this user writes."""
    existing = next((p for p in [folder, *folder.parents] if p.exists()), None)
    return existing is not None and existing.is_dir() and os.access(existing, os.W_OK)


def _drill(profile) -> list[Check]:
    drill = profile.drill
    found = [
        _check("drill.scratch_dir", _writable(drill.scratch_dir), f"{drill.scratch_dir}: drills restore here")
    ]
    if drill.continuation.script is not None:
        found.append(
            _script("drill.continuation.script", drill.continuation.script, ("CKPT_LOAD", "CKPT_SAVE"))
        )
    return found


def _archive(profile) -> list[Check]:
    url = profile.archive.url
    if "://" in url:
        return [_check("archive.url", None, f"{url}: an object store, not contacted by this check")]
    return [_check("archive.url", _writable(Path(url)), f"{url}: a local directory")]


def _health(profile) -> list[Check]:
    raw = profile.health.raw_dir
    return [_check("health.raw_dir", _writable(raw), f"{raw}: raw tool outputs go here")]


def _sign(profile) -> list[Check]:
    """The signing keys the sign section names, loaded as every command loads them."""
    try:
        trust = Trust.of(profile)
    except CkptopsError as e:
        return [_check("sign", False, str(e))]
    return [_check("sign", True, trust.describe())]


def _as_written(profile) -> list[Check]:
    """Whether each path and the job name is what its line in the file says
    (``unquoted_values_cut_short``): a value YAML cut short names another folder or job."""
    try:
        cut = unquoted_values_cut_short(profile)
    except CkptopsError as e:
        return [_check("profile.values", False, str(e), profile.source)]
    if cut:
        return [_check("profile.values", False, "; ".join(cut), profile.source)]
    return [_check("profile.values", True, "every path and the job name read as their lines say")]


def check_profile(profile) -> list[Check]:
    """The profile against this machine, section by section, after its values read as written;
    a section the profile lacks is a line saying what it would enable."""
    found = _as_written(profile) + _save_dir(profile)
    for section, check in (
        ("recovery", _recovery),
        ("drill", _drill),
        ("archive", _archive),
        ("health", _health),
        ("sign", _sign),
    ):
        if getattr(profile, section) is None:
            found.append(_check(section, None, f"not set: it would enable {ENABLES[section]}"))
        else:
            found += check(profile)
    return found


_SLUG = re.compile(r"[^a-z0-9-]+")


def _yaml(value: str) -> str:
    """``value`` as one YAML scalar, double-quoted on one line by YAML's own emitter: it loads
    back as exactly ``value``, whatever it holds."""
    return yaml.safe_dump(value, default_style='"', allow_unicode=True, width=math.inf).rstrip("\n")


def _job_name(name: str | None, save_dir: Path) -> str:
    """``--name``, refused unless a profile may carry it; by default the folder's name made one."""
    if name is None:
        return _SLUG.sub("-", save_dir.name.lower())[:63].strip("-") or "job"
    if not re.fullmatch(SLUG_PATTERN, name):
        raise UsageError(
            f"--name {name!r}: a job's name is lowercase letters, digits and '-', at most 63, "
            "starting with a letter or digit"
        )
    return name


def starting_profile(
    save_dir: Path, script: Path | None = None, name: str | None = None, launcher: str | None = None
) -> str:
    """A profile for the job that saves into ``save_dir`` (its layout from the newest
    checkpoint's saved args) and is launched by ``script`` with ``launcher`` (by default Slurm
    when the script holds ``#SBATCH`` lines), with a comment on each key and on each section
    left to fill in; every value written by ``_yaml``."""
    save_dir = Path(save_dir).resolve()
    if not save_dir.is_dir():
        raise UsageError(f"{save_dir}: no such directory")
    job = _job_name(name, save_dir)
    newest = newest_checkpoint(save_dir)
    if newest is None:
        raise UsageError(f"{save_dir}: no iter_* checkpoint to read the job's layout from")
    saved = saved_layout(newest)
    lines = [
        f"# A starting profile for {job}, read off {_yaml(str(save_dir))} ({newest.name}) by ckptops "
        "profile init.",
        "# Check it against this machine: ckptops profile check -p THIS_FILE",
        "job:",
        f"  name: {_yaml(job)}",
        f"  save_dir: {_yaml(str(save_dir))}",
        f"  layout: {{tensor_parallel: {saved['tensor_parallel']}, pipeline_parallel: "
        f"{saved['pipeline_parallel']}, data_parallel: {saved['data_parallel']}}}  # from {newest.name}",
    ]
    if script is not None:
        lines += _recovery_lines(Path(script).resolve(), launcher, save_dir)
    else:
        lines.append(f"# recovery: {{launcher, script, log_dir}} would enable {ENABLES['recovery']}")
    lines += [
        f"# drill: {{scratch_dir: DIR}} would enable {ENABLES['drill']}",
        f"# archive: {{url: DIR or s3://BUCKET/PREFIX}} would enable {ENABLES['archive']}",
        f"# health: {{nodes: [...], raw_dir: DIR}} would enable {ENABLES['health']}",
    ]
    return "\n".join(lines) + "\n"


def _recovery_lines(script: Path, launcher: str | None, save_dir: Path) -> list[str]:
    """The recovery section: the launcher (Slurm when ``script`` holds ``#SBATCH`` lines, unless
    given), the script and the relaunch's log folder. A script not there yet is read as empty."""
    text = _read(script) if script.exists() else ""
    if launcher is None:
        launcher = "slurm" if "#SBATCH" in text else "local"
        why = "#SBATCH lines in the script" if launcher == "slurm" else "no #SBATCH line in the script"
    else:
        why = "--launcher"
    return [
        "recovery:",
        f"  launcher: {_yaml(launcher)}  # {why}",
        f"  script: {_yaml(str(script))}",
        f"  log_dir: {_yaml(str(save_dir.parent / 'ckptops-logs'))}  # the relaunch's own output, watched",
        "  # step_records: only for a job with its own step recorder (ckptops_records)",
    ]
