"""The production paths on a real Slurm cluster (``make slurm``: slurmctld, nodes n1-n3, munge on
this machine): a drill allocation submitted with ``sbatch --wait`` whose loader runs under srun on
two nodes, its cancellation when it overruns, and drains in slurmctld."""

import json
import subprocess
from pathlib import Path

from tasks.checkpoint.promote import promote
from tasks.cluster import slurm
from tasks.health.actions import DRAIN_LOG, apply_drains, plan_drains
from tasks.health.run import NodeReport
from tasks.health.verdict import Evidence, result
from tasks.outcome import Verdict
from tasks.profile import load_profile
from tasks.recovery.infrastructure import taken_away
from tasks.recovery.job import SlurmJob, slurm_job
from tasks.recovery.phases import Source, detect
from tasks.restore.drill import run_drill
from tests.conftest import variant_profile
from tests.helpers.poll import until

ON_TWO_NODES = (
    ", launcher: slurm, slurm: {nodes: 2, ntasks_per_node: 1, gpus_per_node: 0, exclusive: false, "
    "partition: debug, time_limit: '00:15:00'}"
)


def node_state(node: str) -> tuple[str, str]:
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-n", node, "-o", "%T|%E"], capture_output=True, text=True, timeout=30
    )
    state, _, reason = out.stdout.strip().partition("|")
    return state, reason


def test_a_drill_loads_under_srun_on_two_nodes(slurm_conf, variety, tmp_path, options):
    profile = load_profile(variant_profile(variety, "tp2-distopt-bf16", tmp_path, drill_extra=ON_TWO_NODES))
    promote(profile.job.save_dir, options, 30)
    report = run_drill(profile, "shared")
    assert report.ok, report.reason
    load = json.loads(Path(report.log).with_suffix(".load.json").read_text())
    assert sorted(r["node"] for r in load["ranks"]) == ["n1", "n2"]  # one loader per node
    assert all(r["compared"] and not r["mismatches"] for r in load["ranks"])
    log = Path(report.log).read_text()
    assert "# the Slurm job's output" in log and "drill: loaded iteration 4 in" in log


def test_a_drill_past_its_timeout_is_cancelled(slurm_conf, variety, tmp_path, options, monkeypatch):
    # The loader starts cold, as on a real node: the local cluster's nodes share this machine, and
    # a warm loader (tests/helpers/warm) can load the checkpoint within the 2 s (seen once).
    monkeypatch.delenv("CKPTOPS_WARM_DIR", raising=False)
    profile = load_profile(
        variant_profile(
            variety, "llama-like", tmp_path, drill_extra=ON_TWO_NODES.replace("nodes: 2", "nodes: 1")
        )
    )
    profile = profile.model_copy(
        update={"drill": profile.drill.model_copy(update={"load_timeout_seconds": 2})}
    )
    promote(profile.job.save_dir, options, 30)
    report = run_drill(profile, "shared")
    assert not report.ok and "timed out after 2s" in report.reason
    job = report.reason.rsplit("Slurm job ", 1)[1].split()[0]
    assert job.isdigit() and report.reason.endswith(f"Slurm job {job} cancelled")

    def gone():
        queue = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30
        )
        return queue.stdout.strip() in ("", "CANCELLED")

    until(gone, 60, f"job {job} cancelled")


def test_nodelists_partitions_and_drains_in_slurmctld(slurm_conf, tmp_path):
    assert slurm.expand_nodelist("n[1-3]") == ["n1", "n2", "n3"]
    assert slurm.partition_nodes("debug") == ["n1", "n2", "n3"]
    settings = load_profile(_health_profile(tmp_path)).health
    bad = NodeReport(
        "n2", Verdict.FAIL_HARDWARE, [result("xid", Verdict.FAIL_HARDWARE, Evidence("critical XID 79"))]
    )
    good = NodeReport("n3", Verdict.PASS, [result("xid", Verdict.PASS, Evidence("clean"))])
    try:
        plan = apply_drains(plan_drains([bad, good], settings), settings)
        assert plan.drained == ["n2"]
        state, reason = node_state("n2")
        assert state == "drained" and reason == "ckptops FAIL_HARDWARE xid: critical XID 79"
        assert node_state("n3")[0] == "idle"
    finally:
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], capture_output=True, timeout=30)


def _health_profile(tmp_path: Path) -> Path:
    path = tmp_path / "health.yaml"
    path.write_text(
        f"job: {{name: slurm-test, save_dir: '{tmp_path}'}}\n"
        f"health: {{nodes: [n1, n2, n3], transport: local, raw_dir: '{tmp_path / 'raw'}', "
        "drain: {enabled: true}}\n"
    )
    return path


def _running(script: Path, node: str, tmp_path: Path) -> str:
    """A job on ``node`` that sleeps until cancelled, once slurmctld says it runs."""
    job = slurm.run(["sbatch", "--parsable", "-w", node, "-o", str(tmp_path / "%j.out"), str(script)])
    job = job.strip().split(";")[0]
    until(lambda: slurm.run(["squeue", "-h", "-j", job, "-o", "%T"]).strip() == "RUNNING", 60, "job running")
    return job


def _ended(job: str) -> SlurmJob:
    return slurm_job(job.split(";")[0])  # taken_away waits for its end


def test_slurm_says_when_the_infrastructure_not_the_job_ended_it(slurm_conf, tmp_path):
    """A job cancelled while a maintenance reservation holds its node, and one cancelled after
    ckptops drained its node during its run (a planned spare swap), were ended by the
    infrastructure; a job that failed on its own, and one cancelled with neither, were not."""
    sleeper = tmp_path / "sleep.sh"
    sleeper.write_text("#!/bin/bash\nsleep 600\n")
    failing = tmp_path / "fail.sh"
    failing.write_text("#!/bin/bash\nexit 3\n")
    settings = load_profile(_health_profile(tmp_path)).health
    drains = Path(settings.raw_dir) / DRAIN_LOG
    try:
        job = _running(sleeper, "n2", tmp_path)
        slurm.run(
            [
                "scontrol",
                "create",
                "reservation",
                "ReservationName=ckptops-maint",
                "Nodes=n2",
                "StartTime=now",
                "Duration=10",
                "Flags=MAINT,IGNORE_JOBS",
                "Users=root",
            ]
        )
        slurm.run(["scancel", job])
        assert taken_away(_ended(job), drains) == (
            f"Slurm job {job} CANCELLED while maintenance reservation ckptops-maint held n2"
        )
        job = _running(sleeper, "n3", tmp_path)
        swap = NodeReport(
            "n3", Verdict.FAIL_HARDWARE, [result("xid", Verdict.FAIL_HARDWARE, Evidence("XID 79"))]
        )
        apply_drains(plan_drains([swap], settings), settings)
        slurm.run(["scancel", job])
        assert taken_away(_ended(job), drains).startswith(
            f"Slurm job {job} cancelled after ckptops drained n3 during its run (ckptops FAIL_HARDWARE xid"
        )
        # What a recovery of that job detects, before it reads a line of the job's output.
        found = detect(load_profile(_health_profile(tmp_path)), Source(slurm_job=job))
        assert found.infrastructure == taken_away(_ended(job), drains)
        job = _running(sleeper, "n1", tmp_path)
        slurm.run(["scancel", job])
        assert taken_away(_ended(job), drains) is None
        done = subprocess.run(
            ["sbatch", "--parsable", "--wait", "-w", "n1", "-o", str(tmp_path / "%j.out"), str(failing)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        failed = _ended(done.stdout.strip())
        assert failed.state == "FAILED" and taken_away(failed, drains) is None  # the job's own
    finally:
        subprocess.run(
            ["scontrol", "delete", "ReservationName=ckptops-maint"], capture_output=True, timeout=30
        )
        subprocess.run(["scontrol", "update", "NodeName=n3", "State=RESUME"], capture_output=True, timeout=30)
