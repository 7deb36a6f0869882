"""The recovery run end to end on the real local Slurm cluster (slurmctld, nodes n1-n3): the
local job runs on two nodes, one rank fails with a GPU-style error, and the recovery-run flow,
against a real Prefect server, triages, drains the bad node in slurmctld, admits the spare,
relaunches with --exclude, and validates the resume after an approval given through
``resume_flow_run``. Node health runs over real OpenSSH servers (tests/helpers/cluster.py) that
the Slurm node names reach through an SSH client config."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.local_job.launch import write_job_script
from tasks.recovery.ledger import incidents
from tests.conftest import free_port
from tests.helpers.approver import answer_when_paused
from tests.helpers.cluster import FakeCluster, r3_pass_document, ssh_config

ADDRESSES = {"n1": "127.0.0.21", "n2": "127.0.0.22", "n3": "127.0.0.23"}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Health stand-ins for n1-n3: n2's kernel log holds a critical XID (its GPU is bad), n3 is a
    spare that passes the admission set."""
    root = tmp_path_factory.mktemp("nodes")
    fake = FakeCluster(root, list(ADDRESSES.values()), free_port()).start()
    fake.record_sample(ADDRESSES["n2"], "journal", "synthetic_journal_xid79.txt")
    fake.record(ADDRESSES["n3"], "diag", r3_pass_document())
    yield fake
    fake.stop()


def node_state(node: str) -> tuple[str, str]:
    """The node's state and drain reason, as slurmctld has them."""
    out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True, timeout=30)
    state = re.search(r"State=(\S+)", out.stdout)[1]
    reason = re.search(r"Reason=(.*?)(?: \[|$)", out.stdout)
    return state, reason[1] if reason else ""


def job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    )
    return dict(part.split("=", 1) for part in out.stdout.split() if "=" in part)


def make_job(tmp_path: Path, nodes: FakeCluster, name: str, **recovery) -> tuple[Path, Path, Path]:
    """A save directory, the job's batch script and a profile for it."""
    import getpass

    save, records = tmp_path / "checkpoints", tmp_path / "records.jsonl"
    script = write_job_script(
        tmp_path / "job.sh", save, records, job_name=name, port=free_port(), train_iters=16, save_interval=4
    )
    profile = {
        "job": {"name": name, "save_dir": str(save), "layout": {"data_parallel": 2}},
        "verify": {"settle_seconds": 0, "lock_timeout_seconds": 60},
        "health": {
            "nodes": list(ADDRESSES),
            "spares": ["n3"],
            "transport": "ssh",
            "ssh": {
                "user": getpass.getuser(),
                "port": nodes.port,
                "known_hosts": str(nodes.known_hosts(tmp_path / "known_hosts")),
                "key_file": str(nodes.client_key),
                "config_file": str(ssh_config(tmp_path / "ssh_config", nodes, ADDRESSES)),
                "use_agent": False,
                "connect_timeout_seconds": 5,
            },
            "command_timeout_seconds": 10,
            "diag_timeout_seconds": {1: 5, 3: 10},
            "raw_dir": str(tmp_path / "health"),
            "pairs": {"known_good": "n1", "pass_gbps": 360, "warn_gbps": 350},
            "drain": {"enabled": True},
        },
        "resume": {
            "warmup_steps": 2,
            "min_steps": 4,
            "loss_rel_tolerance": 0.0,
            "memory_band": 0.5,
            "throughput_drop": 0.9,
        },
        "recovery": {
            "launcher": "slurm",
            "script": str(script),
            "step_records": str(records),
            "log_dir": str(tmp_path / "logs"),
            "progress_steps": 6,
            "progress_timeout_seconds": 300,
            "approval_timeout_seconds": 300,
            **recovery,
        },
    }
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    return save, records, path


def submit_failing(script: Path, name: str, fault: str, log_dir: Path) -> str:
    """Run the job to its failure (sbatch --wait); its job id."""
    log_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--wait",
            f"--job-name={name}",
            f"--output={log_dir / '%x-%j.out'}",
            f"--export=ALL,CKPTOPS_FAIL_AT={fault}",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0, "the rehearsed failure did not fail the job"
    return done.stdout.strip().split(";")[0]


def test_a_gpu_failure_on_one_node_is_triaged_drained_relaunched_on_the_spare_and_validated(
    slurm_conf, prefect_api, nodes, tmp_path
):
    from prefect.artifacts import Artifact

    from flows.recovery_run import recovery_run

    name = f"rec-{tmp_path.name[-6:].lower().strip('_')}".replace("_", "-")
    save, records, profile = make_job(tmp_path, nodes, name)
    subprocess.run(
        ["scontrol", "update", "NodeName=n3", "State=DRAIN", "Reason=spare"], check=True, timeout=30
    )
    try:
        failed = submit_failing(Path(tmp_path / "job.sh"), name, "1:7:ecc", tmp_path / "logs")
        assert job_fields(failed)["NodeList"] == "n[1-2]"
        waiter = answer_when_paused({"decision": "approve", "checkpoint": None, "note": "go"}, result := {})
        state = recovery_run(profile=str(profile), slurm_job=failed, mode="ask", return_state=True)
        result["done"] = True
        waiter.join(timeout=30)
        assert state.is_completed(), state.message
        (incident,) = incidents(save)
        assert incident.cls == "hardware" and incident.suspect_nodes == ["n2"]
        assert incident.first_error["text"].endswith(
            "RuntimeError: CUDA error: uncorrectable ECC error encountered"
        )
        # The approver saw the plan before anything was relaunched.
        form = result["form"]
        assert "**hardware**" in form and "drained: n2" in form and "same-failure-again | no" in form
        # n2: drained in slurmctld with the incident in the reason; n3: admitted back.
        assert node_state("n2") == ("IDLE+DRAIN", f"ckptops {incident.id} hardware")
        assert "DRAIN" not in node_state("n3")[0]
        assert incident.drained == ["n2"] and incident.admitted == ["n3"]
        # Relaunched from the newest verified checkpoint, away from n2.
        assert incident.checkpoint == 4 and incident.failure_iteration == 6
        relaunched = job_fields(incident.relaunched_job)
        assert relaunched["ExcNodeList"] == "n2" and relaunched["NodeList"] == "n[1,3]"
        assert incident.outcome == "completed" and incident.validation.startswith("VALIDATED")
        assert incident.recomputed_iterations == 2 and incident.lost_gpu_hours > 0
        phases = [p for p in incident.times]
        assert {"detected", "triaged", "health_done", "approved", "relaunch_submitted", "validated"} <= set(
            phases
        )
        rows = json.loads(Artifact.get(f"incidents-{name}").data)
        assert rows[-1]["incident"] == incident.id and rows[-1]["outcome"] == "completed"
    finally:
        subprocess.run(["scancel", f"--name={name}"], timeout=30)
        subprocess.run(
            ["scontrol", "update", "NodeName=n[1-3]", "State=RESUME"], capture_output=True, timeout=30
        )


def ckptops(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).with_name("ckptops")), *args], capture_output=True, text=True, timeout=600
    )


def test_a_failure_that_comes_back_at_the_same_place_is_stopped_not_relaunched_again(
    slurm_conf, nodes, tmp_path, monkeypatch
):
    """The fault is in the environment the recovery relaunches with, so the relaunched job fails
    exactly as the first did: the first recovery relaunches (and sees the job die before making
    progress), the second is stopped by the same-failure rule and submits nothing."""
    name = f"rep-{tmp_path.name[-6:].lower().strip('_')}".replace("_", "-")
    save, records, profile = make_job(tmp_path, nodes, name)
    monkeypatch.setenv("CKPTOPS_FAIL_AT", "1:7:ecc")
    try:
        first_job = submit_failing(tmp_path / "job.sh", name, "1:7:ecc", tmp_path / "logs")
        first = ckptops("recover", "--slurm-job", first_job, "--approve", "--profile", str(profile), "--json")
        assert first.returncode == 1, first.stderr
        one = json.loads(first.stdout)
        assert one["class"] == "hardware" and one["relaunched_job"] and one["outcome"] == "stopped"
        assert "before 6" in one["reason"]  # the relaunch died after 2 resumed steps
        second = ckptops(
            "recover", "--slurm-job", one["relaunched_job"], "--approve", "--profile", str(profile), "--json"
        )
        assert second.returncode == 1, second.stderr
        two = json.loads(second.stdout)
        assert two["stop_rule"] == "same-failure-again" and two["relaunched_job"] is None
        assert two["failure_iteration"] == one["failure_iteration"] == 6
        assert two["drained"] == [] and one["id"] in two["reason"]
        assert [i.outcome for i in incidents(save)] == ["stopped", "stopped"]
        queued = subprocess.run(
            ["squeue", "-h", f"--name={name}"], capture_output=True, text=True, timeout=30
        )
        assert queued.stdout.strip() == ""
        listed = ckptops("incidents", "--profile", str(profile))
        assert listed.returncode == 0 and "same-failure-again" in listed.stdout
    finally:
        subprocess.run(["scancel", f"--name={name}"], timeout=30)
        subprocess.run(
            ["scontrol", "update", "NodeName=n[1-3]", "State=RESUME"], capture_output=True, timeout=30
        )


def test_a_relaunch_that_makes_no_progress_is_scancelled_before_the_incident_stops(
    slurm_conf, nodes, tmp_path, monkeypatch
):
    name = f"hng-{tmp_path.name[-6:].lower().strip('_')}".replace("_", "-")
    save, records, profile = make_job(tmp_path, nodes, name, progress_timeout_seconds=15)
    try:
        failed = submit_failing(tmp_path / "job.sh", name, "1:7:ecc", tmp_path / "logs")
        # The relaunch inherits a hang: rank 0 stops before iteration 5, the first it would train.
        monkeypatch.setenv("CKPTOPS_FAIL_AT", "0:5:hang")
        done = ckptops("recover", "--slurm-job", failed, "--approve", "--profile", str(profile), "--json")
        assert done.returncode == 1, done.stderr
        incident = json.loads(done.stdout)
        new = incident["relaunched_job"]
        assert new and "0 resumed steps after 15s, wanted 6" in incident["reason"]
        assert f"job {new} cancelled (" in incident["reason"]
        queued = subprocess.run(["squeue", "-h", "-j", new], capture_output=True, text=True, timeout=30)
        assert queued.stdout.strip() == "", "the relaunch is still in the queue"
    finally:
        subprocess.run(["scancel", f"--name={name}"], timeout=30)
        subprocess.run(
            ["scontrol", "update", "NodeName=n[1-3]", "State=RESUME"], capture_output=True, timeout=30
        )


def test_a_node_a_recovery_drained_comes_back_only_through_its_burn_in_and_serves_the_next_job(
    slurm_conf, nodes, tmp_path
):
    """n2 is drained as a recovery drains (its XID, the incident in the reason); n3 by a person.
    The burn-in leaves n3 alone, keeps n2 drained while its GPU still fails, and once n2 passes
    (DCGM r3, NCCL, the pair test with n1) resumes it: the next job runs on it; its history and
    the fleet's table say so."""
    from tasks.health.accounting import fleet
    from tasks.health.burn_in import burn_in
    from tasks.health.sweep import sweep
    from tasks.profile import load_profile

    _, _, profile = make_job(tmp_path, nodes, "burn")
    settings = load_profile(str(profile)).health
    subprocess.run(
        ["scontrol", "update", "NodeName=n3", "State=DRAIN", "Reason=bios update"], check=True, timeout=30
    )
    scenarios = nodes.root / "scenarios" / ADDRESSES["n2"]
    try:
        drained = sweep(settings, ["n2"], reason="ckptops inc-burn hardware", incident="inc-burn")
        assert drained.plan.drained == ["n2"]
        assert node_state("n2") == ("IDLE+DRAIN", "ckptops inc-burn hardware")

        failing = burn_in(settings)
        assert [(o.node, o.action) for o in failing.outcomes] == [("n2", "drained")]
        assert failing.outcomes[0].detail.startswith("failed its burn-in at level 3: ")
        assert node_state("n2")[0] == "IDLE+DRAIN" and failing.exit_code == 1

        for suffix in ("out", "rc"):
            (scenarios / f"journal.{suffix}").unlink()  # the GPU replaced: its kernel log clean
        nodes.record(ADDRESSES["n2"], "diag", r3_pass_document())
        cli = str(Path(sys.executable).with_name("ckptops"))
        done = subprocess.run(
            [cli, "health", "burn-in", "n2", "n3", "--json", "--profile", str(profile)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        passing = json.loads(done.stdout)["nodes"]
        assert [(o["node"], o["action"]) for o in passing] == [("n2", "returned"), ("n3", "untouched")]
        assert passing[0]["detail"] == "passed its burn-in at level 3"
        assert "DRAIN" not in node_state("n2")[0]
        assert node_state("n3") == ("IDLE+DRAIN", "bios update")

        served = subprocess.run(
            [
                "sbatch",
                "--wait",
                "--parsable",
                "-w",
                "n2",
                f"--output={tmp_path / 'next-%j.out'}",
                "--wrap",
                "echo $SLURMD_NODENAME",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert served.returncode == 0, served.stderr
        assert (tmp_path / f"next-{served.stdout.strip()}.out").read_text().strip() == "n2"

        places = {n.node: n.place for n in fleet(settings).nodes}
        assert places == {"n1": "healthy", "n2": "returned", "n3": "spare out of service"}
        shown = subprocess.run(
            [
                str(Path(sys.executable).with_name("ckptops")),
                "health",
                "history",
                "n2",
                "--profile",
                str(profile),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert (
            "burn-in   level 3 FAILED" in shown and "returned  resumed in Slurm: passed its burn-in" in shown
        )
    finally:
        nodes.record_sample(ADDRESSES["n2"], "journal", "synthetic_journal_xid79.txt")
        for suffix in ("out", "rc"):
            (scenarios / f"diag.{suffix}").unlink(missing_ok=True)
        subprocess.run(
            ["scontrol", "update", "NodeName=n[1-3]", "State=RESUME"], capture_output=True, timeout=30
        )
