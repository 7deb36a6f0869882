"""Every write into a shared folder is safe against a planted link, as root (the tests run as
root): what the link points to is never touched. A file replaced whole (``atomic_write``) lands
as a regular file where the link was; a file written in place (a lock, a JSON-lines log, a
command's log) is refused in one line naming it, and nothing is written."""

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.checkpoint import verdicts
from tasks.checkpoint.layout import HISTORY, LOCK, POINTER
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.pins import pin
from tasks.checkpoint.pointer import HOLD, PROMOTIONS, record_promotion, write_hold, write_pointer
from tasks.cluster import process
from tasks.errors import Malformed
from tasks.health import nvrx
from tasks.health.checks import Context
from tasks.health.history import HISTORY as NODE_HISTORY
from tasks.health.history import record_admitted
from tasks.outcome import Verdict
from tasks.recovery.ledger import INCIDENTS, Incident, record
from tasks.restore import launch
from tasks.restore.history import DRILLS, SCRATCH, append_drill, record_scratch
from tasks.storage.local import append_jsonl, write_output
from tests.test_health_history import _report

PRECIOUS = "precious: not ckptops's\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file ckptops must never write, outside the folder it writes in."""
    path = tmp_path / "elsewhere" / "victim"
    path.parent.mkdir()
    path.write_text(PRECIOUS)
    return path


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def untouched(victim: Path) -> bool:
    return victim.read_text() == PRECIOUS and victim.stat().st_nlink == 1


def test_nvrx_segments_never_write_through_a_link(tmp_path, victim):
    """Before: the temporary's predictable name (``.<file>.<pid>.tmp``) was opened through the
    link, so root overwrote its target; a linked lock file made root create its target."""
    directory = tmp_path / "segments"
    directory.mkdir()
    settings = SimpleNamespace(nvrx_segment_dir=directory, command_timeout_seconds=60)
    running = {"gpu1": [("100", "100"), ("200", "3")]}.get
    bad = _report("gpu1", Verdict.FAIL_HARDWARE, "memory on GPU 3: error 83 (ISOLATE)")
    for name in ("segment_health_check.100.100", "segment_health_check.200.3"):
        plant(directory / f".{name}.{os.getpid()}.tmp", victim)
    # A link at a segment file's own name is replaced by ours: it excluded nothing for sure.
    plant(directory / "segment_health_check.200.3", victim)

    done = nvrx.publish([bad], settings, running)
    assert untouched(victim)
    assert done.written == ["segment_health_check.100.100", "segment_health_check.200.3"]
    assert done.errors == [
        "segment_health_check.200.3: a symbolic link; replaced by our file, what it named untouched"
    ]
    assert untouched(victim)
    for name in done.written:
        assert not (directory / name).is_symlink() and nvrx._ours(directory / name)["nodes"]["gpu1"]

    # A link at the lock's name: refused, nothing written, the sweep told in one line.
    created = tmp_path / "elsewhere" / "created-by-root"
    (directory / nvrx.LOCK).unlink()
    plant(directory / nvrx.LOCK, created)
    refused = nvrx.publish([_report("gpu1", Verdict.PASS)], settings, running)
    assert refused.errors == [
        f"health.nvrx_segment_dir: {directory / nvrx.LOCK}: a symbolic link; ckptops writes in place only "
        "a regular file of its own, opened without following links (remove it)"
    ]
    assert not created.exists() and not os.path.lexists(created)
    assert refused.removed == [] and (directory / "segment_health_check.100.100").exists()


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_the_job_lock_refuses_a_linked_lock_file(tmp_path, victim, how):
    """Before: the holder's stamp truncated and overwrote the link's target."""
    save = tmp_path / "save"
    save.mkdir()
    if how == "symlink":
        plant(save / LOCK, victim)
    else:
        os.link(victim, save / LOCK)
    kind = "a symbolic link" if how == "symlink" else "a file with 2 hard links"
    with (
        pytest.raises(Malformed, match=f"^{save / LOCK}: {kind}; ckptops writes in place only"),
        job_lock(save, 1),
    ):
        pass
    assert victim.read_text() == PRECIOUS


class _Drill:
    def to_dict(self):
        return {"source": "shared", "started_at": "2026-12-01T03:00:00", "ok": True}


APPENDS = {
    "promotions": (lambda save: record_promotion(save, 8, None, "promoted"), f"{HISTORY}/{PROMOTIONS}"),
    "ledger": (
        lambda save: record(save, Incident("inc-1", "j", "cli", outcome="running")),
        f"{HISTORY}/{INCIDENTS}",
    ),
    "drills": (lambda save: append_drill(save, _Drill()), f"{HISTORY}/{DRILLS}"),
    "node history": (lambda raw: record_admitted(raw, "gpu1"), f"gpu1/{NODE_HISTORY}"),
    "verdicts": (
        lambda save: verdicts.record(save, 8, 1, 1, "valid", b"{}", "2026-12-04T20:00:00Z"),
        f"{HISTORY}/{verdicts.VERDICTS}",
    ),
    "scratch records": (lambda save: record_scratch(save, {"token": "t"}), f"{HISTORY}/{SCRATCH}"),
}


@pytest.mark.parametrize("log", APPENDS)
def test_a_log_ckptops_appends_to_refuses_a_link_at_its_name(tmp_path, victim, log):
    """Before: the append opened an existing name without O_NOFOLLOW, and added a line to the
    link's target."""
    write, name = APPENDS[log]
    plant(tmp_path / name, victim)
    with pytest.raises(Malformed, match=f"^{tmp_path / name}: a symbolic link; "):
        write(tmp_path)
    assert untouched(victim)


FOLDERS = {
    **{name: (write, where.split("/")[0]) for name, (write, where) in APPENDS.items()},
    "pins": (lambda save: pin(save, 8, "drill-1", "a drill reads it"), ".ckptops-pins"),
    "raw outputs": (
        lambda raw: Context("gpu1", None, None, 1, raw).keep("dcgm-diag", "bindings", "{}"),
        "gpu1",
    ),
}


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_link_planted_at_a_folder_ckptops_keeps_is_refused_not_followed(tmp_path, folder):
    """Before: ``.ckptops-history``, ``.ckptops-pins`` or a node's raw folder planted as a link
    to another folder had ckptops (as root) create and append files in that folder."""
    write, name = FOLDERS[folder]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "save").mkdir()
    root = tmp_path / ("save" if name.startswith(".") else "raw")
    plant(root / name, elsewhere)
    with pytest.raises(Malformed, match=f"^{root / name}: a symbolic link where ckptops keeps a folder"):
        write(root)
    assert list(elsewhere.iterdir()) == []


def test_a_log_that_is_a_fifo_or_has_another_name_is_refused(tmp_path, victim):
    os.link(victim, tmp_path / "hard.jsonl")
    with pytest.raises(Malformed, match="hard.jsonl: a file with 2 hard links"):
        append_jsonl(tmp_path / "hard.jsonl", {"x": 1})
    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(Malformed, match="fifo.jsonl: a FIFO; "):
        append_jsonl(tmp_path / "fifo.jsonl", {"x": 1})
    assert victim.read_text() == PRECIOUS


def _raw_output(tmp_path: Path) -> Path:
    ctx = Context("gpu1", None, None, 1, tmp_path / "raw")
    return Path(ctx.keep("dcgm-diag", "dcgm bindings", "the response"))


REPLACED = {
    "pointer": (lambda d: write_pointer(d, 12), lambda d: [d / POINTER]),
    "rollback hold": (lambda d: write_hold(d, 12), lambda d: [d / HOLD]),
    "pin": (lambda d: pin(d, 12, "op", "kept"), lambda d: [d / ".ckptops-pins" / "iter_0000012@op"]),
    # The raw output's name is the second it is written in: every name of the next seconds.
    "health raw output": (
        _raw_output,
        lambda d: [
            d
            / "raw"
            / "gpu1"
            / f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(time.time() + s))}-dcgm-diag-0.txt"
            for s in range(-1, 30)
        ],
    ),
}


@pytest.mark.parametrize("writer", REPLACED)
def test_a_file_replaced_whole_replaces_a_link_at_its_name_not_its_target(tmp_path, victim, writer):
    """Before: the health check's raw output was written through the link (``write_text``)."""
    write, names = REPLACED[writer]
    planted = [plant(path, victim) for path in names(tmp_path)]
    write(tmp_path)
    assert untouched(victim)
    written = [p for p in planted if not p.is_symlink()]
    assert len(written) == 1 and written[0].stat().st_nlink == 1 and written[0].read_bytes() != b""


def test_a_command_log_refuses_a_link(tmp_path, victim):
    """Before: ``open(log, 'wb')`` emptied the link's target, then the command wrote into it."""
    log = plant(tmp_path / "run.log", victim)
    for append in (False, True):
        with pytest.raises(Malformed, match=f"^{log}: a symbolic link; "):
            process.start([sys.executable, "-c", "print('hello')"], log, append=append)
    assert untouched(victim)
    # A log of its own is emptied (or appended to) as before.
    own = tmp_path / "own.log"
    own.write_text("old\n")
    process.start([sys.executable, "-c", "print('new')"], own).wait(timeout=60)
    assert own.read_text() == "new\n"


def test_the_drill_log_refuses_a_link_when_the_slurm_jobs_output_is_added(tmp_path, victim):
    output = tmp_path / "drill.job.log"
    output.write_text("the loader's lines\n")
    log = plant(tmp_path / "drill.log", victim)
    with pytest.raises(Malformed, match=f"^{log}: a symbolic link; "):
        launch._append(log, output)
    assert untouched(victim) and output.exists()


def test_a_plot_refuses_a_link_at_the_path_given(tmp_path, victim):
    """``--plot PATH`` (``ckptops drills``, ``ckptops incidents``): a link there is refused,
    never followed, never replaced."""
    plot = plant(tmp_path / "trend.png", victim)
    with pytest.raises(Malformed, match=f"^{plot}: a symbolic link; "):
        write_output(plot, b"\x89PNG")
    assert untouched(victim) and plot.is_symlink()
    write_output(tmp_path / "own.png", b"\x89PNG")
    assert (tmp_path / "own.png").read_bytes() == b"\x89PNG"


def test_the_cli_names_a_refused_plot_in_one_line(tmp_path, victim):
    from tests.test_cli import ckptops

    plot = plant(tmp_path / "timeline.png", victim)
    save = tmp_path / "save"
    save.mkdir()
    record(save, Incident("inc-1", "j", "cli", outcome="running", times={"detected": 1.0, "triaged": 2.0}))
    profile = tmp_path / "p.yaml"
    profile.write_text(f"job: {{name: j, save_dir: '{save}'}}\n")
    result = ckptops("incidents", "--profile", profile, "--plot", plot)
    assert result.returncode == 2 and untouched(victim)
    assert result.stderr.strip().splitlines() == [
        f"ckptops: {plot}: a symbolic link; ckptops writes in place only a regular file of its own, "
        "opened without following links (remove it)"
    ]


@pytest.mark.parametrize("hard", [False, True])
def test_a_run_stopped_hard_gets_no_chance_to_act_on_sigterm(tmp_path, hard):
    """Megatron-LM's ``--exit-signal-handler`` saves into ``--save`` on SIGTERM: a run that must
    not do one more thing (a continuation aimed at production, a relaunch that does not fit) is
    killed with SIGKILL at once; the ordinary stop still lets it act on SIGTERM."""
    acted = tmp_path / "saved-on-sigterm"
    script = tmp_path / "job.sh"
    script.write_text(f"trap 'echo saved > {acted}; exit 0' TERM\necho ready\nwhile :; do sleep 0.1; done\n")
    log = tmp_path / "job.log"
    started = process.start(["bash", str(script)], log, dict(os.environ))
    deadline = time.monotonic() + 30
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.terminate(started.pid, 10, hard=hard)
    started.wait(10)
    assert acted.exists() is not hard
