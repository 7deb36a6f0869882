"""``make demo`` end to end, on a profile of its own with a Prefect server of its own: the
deployments registered, a worker running the triggered and requested runs, the job's failure
recovered; a second start (``demo up``) reuses the server and the worker; ``demo down`` stops both."""

import json
import os
import subprocess
import sys

import pytest

from tasks.checkpoint.pointer import read_pointer
from tasks.recovery.ledger import incidents
from tests.conftest import ROOT, free_port


def demo(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return subprocess.run(
        [sys.executable, "-m", "infra.demo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**env, "COLUMNS": "300"},  # long lines unwrapped, to match whole
    )


PROFILE = """\
job: {name: local-tiny, save_dir: checkpoints, layout: {data_parallel: 2}}
verify: {settle_seconds: 1, wait_timeout_seconds: 60, poll_seconds: 1, lock_timeout_seconds: 120}
retention: {keep_verified: 3}
prefect: {api_url: 'API', home: prefect}
local_job: {nproc: 2, train_iters: 16, save_interval: 4, timeout_seconds: 600}
archive: {url: archive, keep: 2}
drill: {scratch_dir: scratch, budget_seconds: {shared: 600, archive: 600}}
health: {nodes: [localhost], transport: local, gpus_per_node: 1, raw_dir: health}
resume: {warmup_steps: 2, min_steps: 4, loss_rel_tolerance: 0.0, memory_band: 0.5, throughput_drop: 0.9}
recovery: {launcher: local, script: job.sh, step_records: records.jsonl, log_dir: logs,
           auto_approve: [hardware], progress_steps: 4, progress_timeout_seconds: 600}
"""


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One demo on a server of its own (left running, as make demo leaves it); stopped at the end."""
    root = tmp_path_factory.mktemp("demo")
    api = f"http://127.0.0.1:{free_port()}/api"
    profile = root / "demo.yaml"
    profile.write_text(PROFILE.replace("API", api))
    try:
        yield root, profile, api, demo(str(profile))
    finally:
        stopped = demo("down", str(profile))
        assert "worker: stopped" in stopped.stdout and "server: stopped" in stopped.stdout
        assert not (root / "prefect" / "worker.pid").exists()


def test_the_story_runs_through_deployments_and_a_worker_and_recovers(demo_run):
    root, _, api, first = demo_run
    out = first.stdout
    assert first.returncode == 0, out[-3000:] + first.stderr[-2000:]
    assert "Prefect server: started" in out and "worker started" in out
    assert "verify-and-promote (triggered by the saves, run by the worker): promoted 12" in out
    assert "archive-copy: Completed: iteration 12: committed" in out
    assert "restore-drill from shared: Completed: PASS drill from shared, iteration 12" in out
    assert "restore-drill from archive: Completed: PASS drill from archive, iteration 12" in out
    assert (
        "node-health: Failed: 1 nodes: FAIL_CONFIG 1; localhost FAIL_CONFIG: gpu-count: no GPUs found" in out
    )
    assert "recovery-run: Completed:" in out and "hardware: completed: resumed from 12" in out
    assert read_pointer(root / "checkpoints") == 16
    assert "goodput-report: Completed: ETTR " in out and ", 1 incidents" in out
    (incident,) = incidents(root / "checkpoints")
    assert incident.cls == "hardware" and incident.outcome == "completed" and incident.checkpoint == 12
    assert api.removesuffix("/api") + "/deployments" in out

    # Every flow has a deployment the UI's Run button starts, and the runs came through them.
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.watchdog import HEARTBEAT_SECONDS, TAG

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        deployments = client.read_deployments()
        names = {f"{client.read_flow(d.flow_id).name}/{d.name}" for d in deployments}
        runs = client.read_flow_runs()
        promoting = client.read_deployment_by_name("verify-and-promote/local-tiny")
    assert promoting.parameters == {"profile": "local"}
    assert promoting.schedules and promoting.schedules[0].schedule.interval.total_seconds() == 30
    # The job's saved events (a plain HTTP POST from the job) started verify-and-promote runs.
    triggered = [r for r in runs if r.deployment_id == promoting.id and r.created_by.type == "AUTOMATION"]
    assert triggered and all(r.parameters == {"profile": "local"} for r in triggered)
    # Every deployment's runs beat their heart at the watchdog's rate and carry its tag.
    for each in deployments:
        if each.entrypoint and each.entrypoint.startswith("flows/") and each.work_pool_name == "ckptops":
            assert TAG in each.tags, each.name
            assert each.job_variables["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == str(HEARTBEAT_SECONDS)
    assert {
        "verify-and-promote/local-tiny",
        "archive-copy/local-tiny-archive",
        "restore-drill/local-tiny-drill-shared",
        "node-health/local-health",
        "post-resume-validation/local-tiny-validate-resume",
        "recovery-run/local-tiny-recovery",
    } <= names
    assert runs and all(r.deployment_id is not None for r in runs)


def test_the_goodput_ledger_reads_the_demos_incident_and_saves(demo_run):
    from tests.test_cli import ckptops

    _, profile, _, first = demo_run
    assert first.returncode == 0
    found = json.loads(ckptops("goodput", "--profile", profile, "--json").stdout)
    assert found["incidents"] == 1 and found["ettr"] is not None and 0 < found["ettr"] < 1
    assert found["restart_seconds"]["seconds"] > 0  # the recovery's downtime, from the ledger
    assert found["lost"]["saves"]["source"].startswith("step loop held after each save")
    assert found["lost"]["detection"]["seconds"] is not None and found["productive"]["seconds"] > 0


def test_the_ui_shows_deployments_checks_the_drill_plot_and_the_node_table_in_a_browser(demo_run, tmp_path):
    from tests.helpers.ui import look

    _, _, api, first = demo_run
    assert first.returncode == 0
    seen = look(api, tmp_path)
    assert "local-health" in seen["health-deployment"] and "recovery-run" in seen["recovery-deployment"]
    assert "records' CRCs match" in seen["verify-checks"]
    assert "decoder.layers" in seen["verify-tensors"]
    assert "localhost" in seen["node-health"] and "no GPUs found" in seen["node-health"]
    for name in (
        "deployments",
        "verify-checks",
        "verify-tensors",
        "drill-trend",
        "node-health",
        "incidents",
        "incident-timeline",
    ):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_second_start_reuses_the_server_and_the_worker(demo_run):
    _, profile, _, first = demo_run
    assert first.returncode == 0
    second = demo("up", str(profile))  # the demo's own start of the services, without the story
    assert second.returncode == 0, second.stdout[-3000:]
    assert "Prefect server: reused" in second.stdout and "worker reused" in second.stdout
    # Nothing of the deployments changed since the first start: they are not registered again.
    assert "deployments up to date (work pool ckptops)" in second.stdout
