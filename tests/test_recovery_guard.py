"""The failure-storm guard on a real Prefect server: more than recovery.max_per_hour recoveries
of the job's own failures (``training.recovery.started`` labelled ``ckptops.cause: job``, as the
recovery run announces itself once triaged; posted here over plain HTTP) pause the job's
recovery deployment; another job's recoveries, and recoveries of failures the infrastructure
caused (a preemption), do not."""

import json
import urllib.request
import uuid
from datetime import UTC, datetime

import pytest
import yaml

from tasks.errors import UsageError
from tasks.events import CAUSE_LABEL, JOB_FAILED, RECOVERY_STARTED, job_resource
from tasks.profile import load_profile
from tasks.recovery.automation import automation_name, install
from tests.helpers.poll import within


def post_failed(api: str, job: str, slurm_job: str, cause: str = "job") -> None:
    """What a recovery run of that Slurm job's failure announces once it has triaged it."""
    event = [
        {
            "id": str(uuid.uuid4()),
            "occurred": datetime.now(UTC).isoformat(),
            "event": RECOVERY_STARTED,
            "resource": {"prefect.resource.id": job_resource(job), CAUSE_LABEL: cause},
            "payload": {"incident": f"i{slurm_job}", "slurm_job": slurm_job, "logs": []},
        }
    ]
    request = urllib.request.Request(
        f"{api}/events", json.dumps(event).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    urllib.request.urlopen(request, timeout=10).close()


def paused(client, deployment_id, timeout: float = 60.0) -> bool:
    """Whether the server paused the deployment within ``timeout`` (the automation acts
    asynchronously, so this polls the deployment's state, with a deadline)."""
    return bool(within(lambda: client.read_deployment(deployment_id).paused, timeout, every=0.5))


def test_more_failures_than_the_hourly_budget_pause_automatic_recovery(prefect_api, tmp_path):
    from prefect import get_client

    path = tmp_path / "storm.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "job": {"name": "storm", "save_dir": str(tmp_path / "ckpt")},
                "recovery": {"script": str(tmp_path / "job.sh"), "max_per_hour": 2},
            }
        )
    )
    profile = load_profile(path)
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("recovery-run")
        deployment = client.create_deployment(flow_id=flow_id, name="storm-recovery")
        with pytest.raises(UsageError, match="'recovery-run/absent': not found"):
            install(profile, "recovery-run/absent")
        install(profile, "recovery-run/storm-recovery")
        (guard,) = install(profile, "recovery-run/storm-recovery")
        assert [a.id for a in client.read_automations_by_name(automation_name("storm"))] == [guard.id]
        assert guard.trigger.threshold == 3
        for n in range(2):
            post_failed(prefect_api, "storm", str(100 + n))
        for n in range(5):
            post_failed(prefect_api, "another-job", str(200 + n))
            post_failed(prefect_api, "storm", str(300 + n), cause="infrastructure")
        assert not paused(client, deployment, timeout=5), "paused within the budget"
        post_failed(prefect_api, "storm", "102")
        assert paused(client, deployment)


def test_the_recovery_deployment_is_started_by_the_jobs_failure_event():
    """Each failure the job's epilog posts starts one recovery run, which announces itself: so the
    guard sees one announcement per failure it has to count."""
    from tests.conftest import ROOT

    deployments = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())["deployments"]
    recovery = [d for d in deployments if d["entrypoint"].startswith("flows/recovery_run.py")]
    triggered = [d for d in recovery if d.get("triggers")]
    assert triggered and all([t["expect"] for t in d["triggers"]] == [[JOB_FAILED]] for d in triggered)
