"""Return to service and NVRx's scheduler-exclusion file: what a drained node must prove, from its
history, and the exclusion file read back by NVRx's own rules (its reader,
fault_tolerance/scheduler_exclusion.py at nvidia-resiliency-ext f7e7f3c2, re-stated in
``nvrx_reader_excludes``). The drains, burn-ins and returns on the real local Slurm cluster are in
tests/test_recovery_slurm.py."""

import json
import os
import re
import stat
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tasks.health import actions, nvrx
from tasks.health import burn_in as burn_in_module
from tasks.health.actions import DRAIN_LOG, DrainPlan, apply_drains
from tasks.health.burn_in import Drained, burn_in, drained_by_us, passing_since, proof
from tasks.health.history import (
    read_history,
    record_burn_in,
    record_returned,
    record_suspect,
    record_verdict,
)
from tasks.outcome import Verdict
from tasks.profile import load_profile

NOW = datetime(2026, 12, 7, 6, 0, tzinfo=UTC)

# NVRx's reader: line 1 exactly this, with its newline, at most 1 MiB; the file's mtime at most
# 30 minutes old (an older, missing or invalid file excludes nothing: it fails open).
_NVRX_LINE = re.compile(rb'\[(?:"[0-9]+"(?:,"[0-9]+")*)?\]')
_NVRX_MAX_AGE, _NVRX_MAX_LINE = 30 * 60, 1 << 20


def nvrx_reader_excludes(directory: Path, job_id: str, task_id: str, now: float) -> bool:
    """Whether NVRx's launcher of ``task_id`` keeps out of the rendezvous, as its reader decides."""
    path = directory / f"scheduler_exclusion.{job_id}.jsonl"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        if os.fstat(fd).st_mtime + _NVRX_MAX_AGE <= now:
            return False
        with os.fdopen(fd, "rb", closefd=False) as f:
            line = f.readline(_NVRX_MAX_LINE + 1)
    finally:
        os.close(fd)
    if not line.endswith(b"\n") or not _NVRX_LINE.fullmatch(line[:-1]):
        return False
    return f'"{task_id}"'.encode() in line


def health_profile(tmp_path: Path, **keys) -> Path:
    """A profile whose health section runs on this host (n1, n2), with ``keys`` over it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "p.yaml"
    settings = {"nodes": ["n1", "n2"], "transport": "local", "raw_dir": str(tmp_path / "raw")}
    path.write_text(json.dumps({"job": {"name": "j", "save_dir": str(tmp_path)}, "health": settings | keys}))
    return path


def health(tmp_path: Path, exclusions: Path | None = None, **burn_in):
    more = {"nvrx_exclusion_dir": str(exclusions)} if exclusions else {}
    return load_profile(str(health_profile(tmp_path, burn_in=burn_in, **more))).health


def drained(node: str, days_ago: float) -> Drained:
    since = (NOW - timedelta(days=days_ago)).timestamp()
    return Drained(node, "ckptops inc-1 hardware", since, "drain", "ckptops inc-1 hardware")


def test_the_history_decides_the_proof_a_drained_node_owes(tmp_path):
    settings = health(tmp_path)
    raw = settings.raw_dir
    record_suspect(raw, "n1", "inc-1", now=NOW - timedelta(days=1))
    assert proof(settings, "n1", NOW) == ("burn-in", 3, 0.0)
    # Two suspicions within health.suspect's 14 days: r4, and 24 h of passing burn-ins.
    record_suspect(raw, "n1", "inc-2", now=NOW - timedelta(hours=2))
    assert proof(settings, "n1", NOW) == ("burn-in", 4, 24.0)
    # A third within 30 days: a person decides.
    record_suspect(raw, "n1", "inc-3", now=NOW - timedelta(hours=1))
    assert proof(settings, "n1", NOW)[0] == "held"
    # The profile's keys set the rule; a burn-in is no admission, earlier suspicions still count.
    record_burn_in(raw, "n1", 4, True, "PASS", NOW)
    strict = health(tmp_path / "other", hold_after=5, repeat_level=3, repeat_hours=2)
    strict_raw = strict.raw_dir
    for n in range(3):
        record_suspect(strict_raw, "n2", f"inc-{n}", now=NOW - timedelta(days=n))
    assert proof(strict, "n2", NOW) == ("burn-in", 3, 2.0)


def test_only_burn_ins_passing_since_the_drain_without_a_failure_count(tmp_path):
    settings = health(tmp_path)
    raw = settings.raw_dir
    record_burn_in(raw, "n1", 4, True, "PASS", NOW - timedelta(days=3))  # before this drain
    node = drained("n1", 2)
    assert passing_since(settings, "n1", node) is None
    record_burn_in(raw, "n1", 4, True, "PASS", NOW - timedelta(hours=30))
    record_burn_in(raw, "n1", 4, False, "FAIL_HARDWARE dcgm-diag", NOW - timedelta(hours=20))
    record_burn_in(raw, "n1", 4, True, "PASS", NOW - timedelta(hours=10))
    record_burn_in(raw, "n1", 4, True, "PASS", NOW - timedelta(hours=5))
    assert passing_since(settings, "n1", node) == NOW - timedelta(hours=10)


def test_the_exclusion_file_is_what_nvrxs_reader_reads_and_a_returned_node_leaves_it(tmp_path, monkeypatch):
    out = tmp_path / "exclusions"
    out.mkdir()
    settings = health(tmp_path, out)
    settings.raw_dir.mkdir(parents=True)
    report = type("R", (), {"started_at": NOW.isoformat(), "summary": "xid 79", "checks": []})
    for node, verdict in (("n1", Verdict.FAIL_HARDWARE), ("n2", Verdict.PASS)):
        report.node, report.verdict = node, verdict
        record_verdict(settings.raw_dir, report)
    monkeypatch.setattr(
        nvrx.slurm, "node_statuses", lambda nodes: {n: ("drain", "ckptops inc-1") for n in nodes}
    )
    # Job 41 runs array task 3 on n1 and 4 on n2; job 42 (a regular job) runs on n1.
    units = {"n1": [("41", "3"), ("42", "42")], "n2": [("41", "4")]}
    monkeypatch.setattr(nvrx, "allocation_units", lambda node: units[node])
    now = time.time()
    update = nvrx.publish_for(settings, now=now)
    assert not update.errors and update.written == [
        "scheduler_exclusion.41.jsonl",
        "scheduler_exclusion.42.jsonl",
    ]
    assert nvrx_reader_excludes(out, "41", "3", now) and not nvrx_reader_excludes(out, "41", "4", now)
    assert nvrx_reader_excludes(out, "42", "42", now)
    lines = [json.loads(line) for line in (out / "scheduler_exclusion.41.jsonl").read_text().splitlines()]
    assert lines[0] == ["3"]
    assert lines[1]["scope"] == "array_task" and lines[1]["excluded_array_tasks"][0]["task_id"] == "3"
    assert lines[2]["excluded_nodes"][0]["node"] == "n1"
    assert lines[2]["excluded_nodes"][0]["valid_until"].endswith("Z")
    assert lines[3] | {"observed_at": None, "valid_until": None} == {
        "type": "observation",
        "node": "n1",
        "state": "drain",
        "reason": "ckptops inc-1",
        "observed_at": None,
        "valid_until": None,
        "array_tasks": [{"task_id": "3", "restart_count": 0}],
    }
    # NVRx ignores a file not rewritten for 30 minutes: every sweep rewrites it.
    assert not nvrx_reader_excludes(out, "41", "3", now + 1801)
    # n1 passes its burn-in and returns: its jobs' files are emptied, then removed once stale.
    record_burn_in(settings.raw_dir, "n1", 3, True, "PASS", NOW)
    record_returned(settings.raw_dir, "n1", "passed its burn-in at level 3", NOW)
    nvrx.publish_for(settings, now=now + 60)
    assert (out / "scheduler_exclusion.41.jsonl").read_text().startswith("[]\n")
    assert not nvrx_reader_excludes(out, "41", "3", now + 60)
    os.utime(out / "scheduler_exclusion.41.jsonl", (now - 3600, now - 3600))
    assert "scheduler_exclusion.41.jsonl" in nvrx.publish_for(settings, now=now + 60).removed
    # Another producer's file, and a link, are left alone.
    (out / "scheduler_exclusion.43.jsonl").write_text('["1"]\n{"type": "decision"}\n')
    (out / "scheduler_exclusion.44.jsonl").symlink_to(tmp_path / "elsewhere")
    report.node, report.verdict = "n2", Verdict.FAIL_HARDWARE
    record_verdict(settings.raw_dir, report)
    units["n2"] = [("43", "1"), ("44", "44")]
    done = nvrx.publish_for(settings, now=now + 120)
    assert (out / "scheduler_exclusion.43.jsonl").read_text() == '["1"]\n{"type": "decision"}\n'
    assert not (tmp_path / "elsewhere").exists()
    assert [e.split(":")[0] for e in done.errors] == [
        "scheduler_exclusion.43.jsonl",
        "scheduler_exclusion.44.jsonl",
    ]


def test_the_burn_in_flow_shows_the_fleet_and_fails_when_spares_run_short(prefect_api, tmp_path, monkeypatch):
    """Nothing of ckptops' is drained: the flow burns in nothing, leaves n2 (a person's drain)
    alone, publishes the fleet's table, and fails because the one spare is in use."""
    from prefect.artifacts import Artifact

    from flows.node_burn_in import node_burn_in

    folder = tmp_path / "bin"
    folder.mkdir()
    sinfo = folder / "sinfo"
    sinfo.write_text("#!/bin/sh\nprintf 'n1|idle|none\\nn2|drain|bios update\\ns1|alloc|none\\n'\n")
    sinfo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    profile = health_profile(tmp_path, spares=["s1"], burn_in={"min_ready_spares": 1})
    state = node_burn_in(profile=str(profile), return_state=True)
    assert state.is_failed()
    assert state.message.startswith("no node drained by ckptops is held out of service; 3 nodes: ")
    assert "spares running out: 0 ready, health.burn_in.min_ready_spares is 1 (1 in use" in state.message
    rows = {row["node"]: row for row in json.loads(Artifact.get("fleet").data)}
    assert rows["n2"]["place"] == "drained by someone else" and rows["n2"]["detail"] == "bios update"
    assert rows["s1"]["place"] == "spare in use" and rows["n1"]["place"] == "healthy"


NOBODY = 65534  # another local account


def _drains_enabled(tmp_path: Path, monkeypatch):
    """Settings that drain, a Slurm that takes any drain, and a run_health never to be reached."""
    settings = load_profile(str(health_profile(tmp_path, drain={"enabled": True}))).health
    monkeypatch.setattr(actions.slurm, "drain", lambda node, reason: None)

    def no_burn_in(*args, **kwargs):
        raise AssertionError("a burn-in ran on a drain or history ckptops cannot prove is its own")

    monkeypatch.setattr(burn_in_module, "run_health", no_burn_in)
    return settings


def _slurm_holds(monkeypatch, reason: str) -> None:
    monkeypatch.setattr(
        burn_in_module.slurm, "node_statuses", lambda nodes: {n: ("drain", reason) for n in nodes}
    )


def test_a_drain_line_another_account_wrote_proves_no_drain(tmp_path, monkeypatch, caplog):
    """Before: a line appended by another user to the drains log in a world-writable raw_dir made
    a person's drain look like ckptops's, and a passing burn-in would have resumed the node."""
    settings = _drains_enabled(tmp_path, monkeypatch)
    raw = settings.raw_dir
    raw.mkdir()
    os.chmod(raw, 0o777)
    log = raw / DRAIN_LOG
    log.write_text(json.dumps({"at": NOW.timestamp(), "node": "n1", "reason": "alice: reseat DIMM"}) + "\n")
    os.chown(log, NOBODY, NOBODY)
    _slurm_holds(monkeypatch, "alice: reseat DIMM")
    with caplog.at_level("WARNING"):
        assert drained_by_us(settings) == {}
        done = burn_in(settings, only=["n1"])
    assert [o.line() for o in done.outcomes] == [
        "n1: untouched: not held out of service by a drain of ckptops'"
    ]
    warned = [r.getMessage() for r in caplog.records if str(log) in r.getMessage()]
    assert warned and warned[0].startswith(f"{log}: owned by another account than ckptops's")
    assert "owner nobody (uid 65534)" in warned[0] and f"nothing in {log} is trusted" in warned[0]

    # A log of ckptops's own in that world-writable folder proves nothing either: anybody could
    # have replaced it; in a sticky one (as /tmp) nobody else can, and its drains count.
    os.chown(log, 0, 0)
    os.chmod(log, 0o600)
    assert drained_by_us(settings) == {}
    os.chmod(raw, 0o1777)
    assert list(drained_by_us(settings)) == ["n1"]


def test_drains_and_histories_are_written_private_and_read_back_as_ckptops_own(tmp_path, monkeypatch):
    settings = _drains_enabled(tmp_path, monkeypatch)
    apply_drains(DrainPlan(drain=[("n1", "ckptops FAIL_HARDWARE dcgm-diag")]), settings, NOW.timestamp())
    record_suspect(settings.raw_dir, "n1", "inc-1", now=NOW)
    for path in (settings.raw_dir / DRAIN_LOG, settings.raw_dir / "n1" / "history.jsonl"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    _slurm_holds(monkeypatch, "ckptops FAIL_HARDWARE dcgm-diag")
    assert drained_by_us(settings)["n1"].ours
    assert [e["incident"] for e in read_history(settings.raw_dir, "n1")] == ["inc-1"]


def test_a_node_whose_history_another_account_could_write_is_held_for_a_person(tmp_path, monkeypatch, caplog):
    """A forged ``admitted`` or ``burn-in`` line would lapse suspicions or shorten the proof: a
    history ckptops cannot prove is its own decides nothing, and the node waits for a person."""
    settings = _drains_enabled(tmp_path, monkeypatch)
    apply_drains(DrainPlan(drain=[("n1", "ckptops FAIL_HARDWARE dcgm-diag")]), settings, NOW.timestamp())
    history = settings.raw_dir / "n1" / "history.jsonl"
    history.parent.mkdir()
    history.write_text(json.dumps({"kind": "admitted", "at": NOW.isoformat()}) + "\n")
    os.chown(history, NOBODY, NOBODY)
    _slurm_holds(monkeypatch, "ckptops FAIL_HARDWARE dcgm-diag")
    with caplog.at_level("WARNING"):
        assert read_history(settings.raw_dir, "n1") == []
        (outcome,) = burn_in(settings, only=["n1"], now=NOW.timestamp()).outcomes
    assert outcome.action == "held"
    assert outcome.detail.startswith(f"its history is not ckptops's own ({history}: owned by another account")
    assert outcome.detail.endswith("): a person decides")


def test_an_untrusted_history_never_lifts_an_exclusion_and_an_old_group_writable_raw_dir_heals(
    tmp_path, monkeypatch
):
    """Before: a history ckptops could not trust read as empty, so the next sweep rewrote the
    exclusion file ``[]`` and a node that failed its checks was free for NVRx's restarts; and a
    ``raw_dir`` the old code made 0775 (``mkdir`` under a umask of 002) was never trusted again."""
    out = tmp_path / "exclusions"
    out.mkdir()
    settings = health(tmp_path, out)
    raw = settings.raw_dir
    report = type("R", (), {"started_at": NOW.isoformat(), "summary": "xid 79", "checks": []})
    report.node, report.verdict = "n1", Verdict.FAIL_HARDWARE
    record_verdict(raw, report)
    monkeypatch.setattr(
        nvrx.slurm, "node_statuses", lambda nodes: {n: ("drain", "ckptops inc-1") for n in nodes}
    )
    monkeypatch.setattr(nvrx, "allocation_units", lambda node: [("41", "3")])
    now = time.time()
    assert nvrx.publish_for(settings, now=now).written == ["scheduler_exclusion.41.jsonl"]
    path = out / "scheduler_exclusion.41.jsonl"
    published = path.read_bytes()
    # The old code's 0775 raw_dir, here another account's (nothing ckptops may heal): untrusted.
    os.chmod(raw, 0o775)
    os.chown(raw, 65534, 65534)
    update = nvrx.publish_for(settings, now=now + 60)
    assert path.read_bytes() == published and nvrx_reader_excludes(out, "41", "3", now + 60)
    assert not update.written and not update.removed
    (error,) = update.errors
    assert error.startswith(f"{raw}: owned by another account than ckptops's") and error.endswith(
        f"exclusion files in {out} left unchanged"
    )
    # ckptops's own raw_dir, left 0775 by the old code: made 0755, and trusted again.
    os.chown(raw, os.geteuid(), os.getegid())
    update = nvrx.publish_for(settings, now=now + 120)
    assert not update.errors and update.written == ["scheduler_exclusion.41.jsonl"]
    assert stat.S_IMODE(os.stat(raw).st_mode) == 0o755
    assert nvrx_reader_excludes(out, "41", "3", now + 120)
    # A node's folder the old code left 0775 is made 0755 by the next line written there.
    os.chmod(raw / "n1", 0o775)
    record_burn_in(raw, "n1", 3, False, "FAIL_HARDWARE dcgm-diag", NOW)
    assert stat.S_IMODE(os.stat(raw / "n1").st_mode) == 0o755
    assert [e["kind"] for e in read_history(raw, "n1")] == ["verdict", "burn-in"]
