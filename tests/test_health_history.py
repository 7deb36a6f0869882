"""A node's history (verdicts and the incidents naming it), the repeat-suspect rule, NVRx's
exclusion files, and the gpu-processes check: against real OpenSSH servers whose GPU tools
replay recordings (tests/helpers/cluster.py), real files, and the local Slurm cluster."""

import json
import os
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.health import nvrx
from tasks.health.history import (
    counted_suspicions,
    read_history,
    record_admitted,
    record_suspect,
    suspect_check,
)
from tasks.health.run import NodeReport, check_node
from tasks.outcome import Verdict
from tasks.profile import load_profile
from tasks.recovery.phases import nodes_phase
from tasks.recovery.report import plan_markdown
from tests.conftest import ROOT, free_port
from tests.helpers.cluster import DATA, FakeCluster, profile_yaml

NODES = ["127.0.0.21", "127.0.0.22", "127.0.0.23"]
A, B, C = NODES
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    fake = FakeCluster(tmp_path_factory.mktemp("cluster"), NODES, free_port()).start()
    yield fake
    fake.stop()


def make_profile(cluster, tmp_path, **extra):
    path = tmp_path / "health.yaml"
    known_hosts = cluster.known_hosts(tmp_path / "known_hosts")
    path.write_text(profile_yaml(cluster, NODES, known_hosts, tmp_path / "raw", **extra))
    return path, load_profile(path)


def rule(repeat=2, window_days=14):
    return SimpleNamespace(suspect=SimpleNamespace(repeat=repeat, window_days=window_days))


def test_suspicions_count_once_per_incident_within_the_window_and_since_the_last_admission(tmp_path):
    raw = tmp_path / "raw"
    assert record_suspect(raw, "gpu1", "inc-1", "ckptops inc-1 hang", now=NOW - timedelta(days=20))
    assert record_suspect(raw, "gpu1", "inc-2", now=NOW - timedelta(days=3))
    assert not record_suspect(raw, "gpu1", "inc-2", now=NOW)  # a recovery run again counts once
    assert suspect_check(raw, "gpu1", rule(), NOW) is None  # inc-1 is older than 14 days
    assert suspect_check(raw, "gpu1", rule(window_days=30), NOW).verdict is Verdict.FAIL_HARDWARE
    record_suspect(raw, "gpu1", "inc-3", now=NOW - timedelta(days=1))
    check = suspect_check(raw, "gpu1", rule(), NOW)
    assert check.verdict is Verdict.FAIL_HARDWARE and check.name == "suspect-history"
    assert check.detail.startswith("named as suspect in 2 incidents within 14 days: inc-2 (2026-11-28")
    assert suspect_check(raw, "gpu1", rule(repeat=3), NOW) is None
    # Passing the spare admission set starts the count afresh.
    record_admitted(raw, "gpu1", now=NOW - timedelta(hours=1))
    assert counted_suspicions(read_history(raw, "gpu1"), 14, NOW) == []
    assert suspect_check(raw, "gpu1", rule(repeat=1), NOW) is None
    assert [e["kind"] for e in read_history(raw, "gpu1")] == ["suspect", "suspect", "suspect", "admitted"]


def test_a_repeat_suspect_is_drained_within_the_caps_and_the_approval_form_shows_why(
    cluster, tmp_path, scontrol
):
    path, profile = make_profile(cluster, tmp_path, drain={"max_per_run": 1})
    health = profile.health
    first = SimpleNamespace(id="inc-1", cls="hang", suspect_gpus=[])
    drained, excluded, _, note = nodes_phase(profile, first, [A, B], NODES)
    assert drained == [] and excluded == [A, B]  # one incident: excluded, not drained
    assert note == f"{A} PASS: all checks passed; {B} PASS: all checks passed"

    # Megatron's rerun state machine convicted a GPU of A: the drain and the history name it.
    second = SimpleNamespace(id="inc-2", cls="hardware", suspect_gpus=[f"{A}:3"])
    drained, excluded, _, note = nodes_phase(profile, second, [A, B], NODES)
    assert drained == [A] and excluded == [A, B]  # both repeat suspects; the cap drains one
    assert (
        f"{A} FAIL_HARDWARE: suspect-history: named as suspect in 2 incidents within 14 days: inc-1 (" in note
    )
    drains = scontrol.read_text().splitlines()
    assert drains == [f"update NodeName={A} State=DRAIN Reason=ckptops inc-2 hardware GPU {A}:3"]
    suspicions = [e for e in read_history(health.raw_dir, A) if e["kind"] == "suspect"]
    assert suspicions[-1]["detail"] == f"ckptops inc-2 hardware GPU {A}:3"
    # Its own checks passed, and the history says so beside the suspicions.
    verdicts = [e for e in read_history(health.raw_dir, A) if e["kind"] == "verdict"]
    assert [v["verdict"] for v in verdicts] == ["PASS", "FAIL_HARDWARE"]
    assert {c["check"]: c["verdict"] for c in verdicts[-1]["checks"]}["dcgm-diag"] == "PASS"

    form = plan_markdown(
        SimpleNamespace(
            triage=SimpleNamespace(cls="hardware", reason="rerun", first_error=None, suspect_nodes=[A, B]),
            incident=SimpleNamespace(
                id="inc-2", job="j", failed_job="7", reverified=[], health=note, fallback=None, skipped=None
            ),
            checkpoint=20,
            choices=[20],
            certified={20: None},
            drained=drained,
            exclude=excluded,
            admitted=[],
            relaunch="sbatch ...",
            rules=[],
            fits=None,
        )
    )
    assert f"- node health: {A} FAIL_HARDWARE: suspect-history: named as suspect in 2 incidents" in form

    # `ckptops health history NODE` shows the record; a node never named is no repeat suspect.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [str(ROOT / ".venv" / "bin" / "ckptops"), "health", "history"]
    shown = subprocess.run(
        [*cli, A, "--profile", str(path)], capture_output=True, text=True, timeout=60, env=env
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "suspect   incident inc-1: ckptops inc-1 hang" in lines[0]
    assert "FAIL_HARDWARE suspect-history: named as suspect in 2 incidents" in shown.stdout
    assert lines[-1].startswith(
        f"{A}: named as suspect in 2 incidents within 14 days (the rule: 2): a repeat"
    )
    as_json = subprocess.run(
        [*cli, C, "--profile", str(path), "--json"], capture_output=True, text=True, timeout=60, env=env
    )
    never_named = json.loads(as_json.stdout)
    assert (never_named["node"], never_named["counted_incidents"], never_named["repeat_suspect"]) == (
        C,
        [],
        False,
    )
    # C ran with the failed jobs, not as a suspect: only its gpu-processes verdicts are recorded.
    assert {e["kind"] for e in never_named["entries"]} == {"verdict"}
    bad = subprocess.run(
        [*cli, "n1;reboot", "--profile", str(path)], capture_output=True, text=True, timeout=60, env=env
    )
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "n1;reboot" in bad.stderr


def test_a_job_node_whose_gpus_a_dead_process_holds_is_left_out_of_the_relaunch(cluster, tmp_path, scontrol):
    """The failed job's nodes that are not suspects get the gpu-processes check before the
    relaunch: one whose GPUs hold processes of no running job is excluded (not drained: a process
    to kill, not a fault), with suspects or without (a NaN, a hang: the whole job relaunches)."""
    _, profile = make_profile(cluster, tmp_path)
    cluster.record_sample(C, "compute-apps", "nvidia_smi_compute_apps_8xH200_before.csv")
    cluster.record_sample(C, "listpids", "synthetic_scontrol_listpids_h200_job.txt")
    try:
        incident = SimpleNamespace(id="inc-9", cls="hardware", suspect_gpus=[])
        drained, excluded, _, note = nodes_phase(profile, incident, [A], NODES)
        numerics = SimpleNamespace(id="inc-10", cls="numerics", suspect_gpus=[])
        _, no_suspects, _, numerics_note = nodes_phase(profile, numerics, [], NODES)
    finally:
        cluster.record_sample(C, "compute-apps", "nvidia_smi_compute_apps_header_only.csv")
    assert excluded == [A, C] and drained == []
    assert note.startswith(f"{A} PASS: all checks passed; job node {C} FAIL_CONFIG: gpu-processes: GPU GPU-")
    assert note.endswith("belongs to no running Slurm job (and 4 more) (excluded)") and B not in note
    assert no_suspects == [C] and numerics_note.startswith(f"no suspects to check; job node {C} FAIL_CONFIG")
    assert not scontrol.exists()  # nothing drained
    # Only the check that ran is in its history: B and C were not suspects of the incident.
    (last,) = [e for e in read_history(profile.health.raw_dir, C) if e["kind"] == "verdict"][-1:]
    assert [c["check"] for c in last["checks"]] == ["gpu-processes"]
    assert not [e for e in read_history(profile.health.raw_dir, B) if e["kind"] == "suspect"]


def _nvrx_excludes(directory: Path, job_id: str, task_id: str) -> bool:
    """NVRx's reading, as its integration guide states the contract (docs/source/fault_tolerance/
    integration/segment_health_check.rst, NVIDIA/nvidia-resiliency-ext): a non-empty regular file
    segment_health_check.<job_id>.<task_id> excludes the unit; missing or empty joins."""
    path = directory / f"segment_health_check.{job_id}.{task_id}"
    try:
        found = path.stat()
    except FileNotFoundError:
        return False
    return path.is_file() and found.st_size > 0


def _report(node: str, verdict: Verdict, summary: str = "") -> NodeReport:
    report = NodeReport(node, verdict)
    return report if not summary else _with_summary(report, summary)


def _with_summary(report: NodeReport, summary: str) -> NodeReport:
    from tasks.health.verdict import Evidence, result

    report.checks.append(result("dcgm-diag", report.verdict, Evidence(summary)))
    return report


def test_nvrx_segment_files_follow_the_verdicts(tmp_path):
    directory = tmp_path / "segments"
    directory.mkdir()
    settings = SimpleNamespace(nvrx_segment_dir=directory, command_timeout_seconds=60)
    running = {"gpu1": [("100", "100"), ("200", "3")], "gpu2": [("200", "3"), ("200", "4")], "gpu3": []}
    other = directory / "segment_health_check.300.300"
    other.write_text("excluded by another tool\n")

    bad = _report("gpu1", Verdict.FAIL_HARDWARE, "memory on GPU 3: error 83 (ISOLATE)")
    done = nvrx.publish([bad, _report("gpu2", Verdict.SUSPECT, "timed out")], settings, running.get)
    assert done.written == ["segment_health_check.100.100", "segment_health_check.200.3"] and not done.errors
    assert _nvrx_excludes(directory, "100", "100") and _nvrx_excludes(directory, "200", "3")
    assert not _nvrx_excludes(directory, "200", "4")  # gpu2 is SUSPECT only: nothing written for it
    content = json.loads((directory / "segment_health_check.200.3").read_text())
    assert content["nodes"]["gpu1"]["why"] == "dcgm-diag: memory on GPU 3: error 83 (ISOLATE)"

    # Two unhealthy nodes in one unit: the file stays until both pass again.
    nvrx.publish([_report("gpu2", Verdict.FAIL_CONFIG, "persistence mode")], settings, running.get)
    assert _nvrx_excludes(directory, "200", "4")
    done = nvrx.publish([_report("gpu1", Verdict.PASS)], settings, running.get)
    assert done.removed == ["segment_health_check.100.100"]
    assert not _nvrx_excludes(directory, "100", "100") and _nvrx_excludes(directory, "200", "3")
    assert list(json.loads((directory / "segment_health_check.200.3").read_text())["nodes"]) == ["gpu2"]
    done = nvrx.publish([_report("gpu2", Verdict.WARN, "a warning")], settings, running.get)
    assert done.removed == ["segment_health_check.200.3", "segment_health_check.200.4"]
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == [other.name]
    assert other.read_text() == "excluded by another tool\n"  # never ours to remove

    # A relative directory is the profile's folder's, as every path of a profile is; one that is
    # not there, and a node Slurm refuses, are one line each, naming it.
    relative = tmp_path / "relative.yaml"
    relative.write_text(
        json.dumps(
            {
                "job": {"name": "h", "save_dir": str(tmp_path)},
                "health": {
                    "nodes": ["n1"],
                    "transport": "local",
                    "raw_dir": str(tmp_path),
                    "nvrx_segment_dir": "seg",
                },
            }
        )
    )
    assert load_profile(relative).health.nvrx_segment_dir == tmp_path / "seg"
    missing = nvrx.publish(
        [bad], SimpleNamespace(nvrx_segment_dir=tmp_path / "nowhere", command_timeout_seconds=60), running.get
    )
    assert missing.errors == [f"health.nvrx_segment_dir {tmp_path / 'nowhere'}: not a directory"]

    def refuses(node):
        from tasks.errors import CkptopsError

        raise CkptopsError("squeue -h: exited 1: slurm_load_jobs error: Invalid node name specified")

    refused = nvrx.publish([bad], settings, refuses)
    assert refused.errors == ["gpu1: squeue -h: exited 1: slurm_load_jobs error: Invalid node name specified"]


# On the local Slurm cluster: real jobs, real squeue and scontrol listpids.

JOB = """#!/bin/bash
echo $$ > "$OUT/pid.$SLURM_JOB_ID"
while [ ! -e "$OUT/go" ]; do sleep 0.1; done
job=${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}
task=${SLURM_ARRAY_TASK_ID:-$SLURM_JOB_ID}
file="$SEG/segment_health_check.$job.$task"
# NVRx's documented reading: a non-empty regular file excludes this allocation unit.
if [ -f "$file" ] && [ -s "$file" ]; then answer=excluded; else answer=join; fi
echo "$answer" > "$OUT/answer.$job.$task.tmp" && mv "$OUT/answer.$job.$task.tmp" "$OUT/answer.$job.$task"
"""


def _wait_for(condition, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.2)
    return found


def _sbatch(*args: str) -> str:
    done = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _running_on(job: str) -> dict[str, str]:
    """A running job's (or array's) task ids -> node."""
    out = subprocess.run(
        ["squeue", "-h", "-t", "RUNNING", "-j", job, "-o", "%i %N"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def test_gpus_held_outside_any_job_and_nvrx_exclusion_on_real_slurm(slurm_conf, tmp_path, monkeypatch):
    out, seg = tmp_path / "out", tmp_path / "segments"
    out.mkdir()
    seg.mkdir()
    (tmp_path / "job.sh").write_text(JOB)
    common = [f"--export=ALL,OUT={out},SEG={seg}", "-o", str(tmp_path / "slurm-%j.out"), "-t", "5"]
    jobs = [_sbatch(*common, str(tmp_path / "job.sh"))]
    stray = None
    try:
        node = _wait_for(lambda: _running_on(jobs[0]).get(jobs[0]), "the regular job running")
        jobs.append(_sbatch(*common, "-w", node, "--array=0-1", str(tmp_path / "job.sh")))
        array_tasks = _wait_for(lambda: len(_running_on(jobs[1])) == 2 and _running_on(jobs[1]), "the array")
        assert set(array_tasks.values()) == {node}
        pid_file = out / f"pid.{jobs[0]}"
        _wait_for(lambda: pid_file.exists() and pid_file.read_text().endswith("\n"), "the job's pid")
        batch_pid = int(pid_file.read_text())

        # gpu-processes: a process in a running job step is owned; one started outside any job is not.
        stray = subprocess.Popen(["sleep", "600"])
        recorded = (DATA / "nvidia_smi_compute_apps_8xH200_after.csv").read_text().splitlines()
        rows = [
            recorded[0],
            recorded[1].replace("1328667", str(batch_pid)),
            recorded[2].replace("1328668", str(stray.pid)),
        ]
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (tmp_path / "apps.csv").write_text("\n".join(rows) + "\n")
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\ncat {tmp_path / 'apps.csv'}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        profile_path = tmp_path / "p.yaml"
        profile_path.write_text(
            json.dumps(
                {
                    "job": {"name": "h", "save_dir": str(tmp_path)},
                    "health": {
                        "nodes": [node],
                        "transport": "local",
                        "raw_dir": str(tmp_path / "raw"),
                        "checks": ["gpu-processes"],
                        "gpu_processes": {"listpids_node_name": True},
                        "nvrx_segment_dir": str(seg),
                    },
                }
            )
        )
        health = load_profile(profile_path).health
        report = check_node(node, health, 1)
        check = report.checks[0]
        assert report.verdict is Verdict.FAIL_CONFIG, report.summary
        assert [e.value for e in check.evidence] == [stray.pid]  # the job's process is not named
        assert check.detail == (
            f"GPU GPU-4f31bb83-f8dc-d0af-029e-bc4356e6afeb: pid {stray.pid} (/usr/local/bin/python3.10, "
            "130044 MiB) belongs to no running Slurm job"
        )
        stray.kill()
        stray.wait(timeout=30)
        (tmp_path / "apps.csv").write_text("\n".join(rows[:2]) + "\n")
        passed = check_node(node, health, 1)
        assert passed.verdict is Verdict.PASS
        assert passed.checks[0].detail == f"1 compute process, all in running Slurm jobs ({jobs[0]})"

        # NVRx: the failing node's allocation units (real squeue) get their segment files, which
        # the running jobs themselves read as NVRx does, by their own Slurm ids.
        assert {(jobs[0], jobs[0]), (jobs[1], "0"), (jobs[1], "1")} <= set(nvrx.allocation_units(node))
        done = nvrx.publish([report], health)
        assert not done.errors
        assert {f"segment_health_check.{jobs[0]}.{jobs[0]}", f"segment_health_check.{jobs[1]}.0"} <= set(
            done.written
        )
        (out / "go").touch()
        answers = [
            out / f"answer.{jobs[0]}.{jobs[0]}",
            out / f"answer.{jobs[1]}.0",
            out / f"answer.{jobs[1]}.1",
        ]
        _wait_for(lambda: all(a.exists() for a in answers), "the jobs' answers")
        assert [a.read_text().strip() for a in answers] == ["excluded", "excluded", "excluded"]
        # Passing again removes them.
        assert f"segment_health_check.{jobs[0]}.{jobs[0]}" in nvrx.publish([passed], health).removed
        assert not list(seg.glob("segment_health_check.*"))
    finally:
        if stray is not None and stray.poll() is None:
            stray.kill()
            stray.wait(timeout=30)
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)
