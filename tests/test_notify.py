"""Notifications reach a person: through the Prefect notification block the profile names
(here a custom webhook pointing at an HTTP receiver started by the test), from node health's
stop-and-page, a failed drill, a recovery that stops, and the approval notice automation; a
block that does not exist leaves the run finished, its summary saying so."""

import contextvars
import shutil
import threading
from pathlib import Path

import pytest
import yaml

from infra.local_job.launch import write_job_script
from tests.conftest import iter_dir
from tests.helpers.receiver import Receiver

DATA = Path(__file__).parent / "data" / "triage"


@pytest.fixture(scope="module")
def receiver(prefect_api):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    found = Receiver()
    CustomWebhookNotificationBlock(
        name="pager",
        url=found.url,
        json_data={"subject": "{{subject}}", "text": "{{body}}"},
        allow_private_urls=True,
    ).save("test-pager", overwrite=True)
    yield found
    found.close()


def write(tmp_path: Path, data: dict, name: str = "profile.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_stop_and_page_from_node_health_reaches_the_receiver_with_the_run_link(receiver, tmp_path):
    from flows.node_health import node_health

    before = len(receiver.bodies)
    profile = write(
        tmp_path,
        {
            "job": {"name": "paged", "save_dir": str(tmp_path)},
            # Two "nodes" on this GPU-less host fail the same check: a regression, not two bad nodes.
            "health": {
                "nodes": ["localhost", "127.0.0.1"],
                "transport": "local",
                "gpus_per_node": 1,
                "raw_dir": str(tmp_path / "health"),
                "drain": {"enabled": True, "page_when_same_check_fails": 2},
            },
            "notify": {"block": "custom-webhook/test-pager"},
        },
    )
    state = node_health(profile=profile, return_state=True)
    assert state.is_failed() and state.message.startswith("PAGE: 2 nodes fail gpu-count at once")
    body = receiver.wait(before + 1)[before]
    assert body["subject"] == "ckptops paged: node health: stop and page"
    assert body["text"].startswith("[paged] PAGE: 2 nodes fail gpu-count at once")
    assert f"/runs/flow-run/{state.state_details.flow_run_id}" in body["text"]


def test_a_failed_drill_and_a_stopped_recovery_notify_and_a_missing_block_only_says_so(
    receiver, save_dir, tmp_path
):
    from flows.recovery_run import recovery_run
    from flows.restore_drill import restore_drill
    from tasks.checkpoint.promote import promote
    from tasks.checkpoint.state import VerifyOptions

    promote(save_dir, VerifyOptions(job="notify", megatron_core_version="0.19.2"), 60)
    before = len(receiver.bodies)
    job = {"name": "notified", "save_dir": str(save_dir), "layout": {"data_parallel": 2}}
    profile = write(
        tmp_path,
        {
            "job": job,
            "drill": {"scratch_dir": str(tmp_path / "scratch"), "budget_seconds": {"shared": 0.001}},
            "recovery": {"launcher": "local", "script": str(tmp_path / "job.sh")},
            "notify": {"block": "custom-webhook/test-pager"},
        },
    )
    drilled = restore_drill(profile=profile, source="shared", return_state=True)
    assert drilled.is_failed() and "FAIL drill from shared" in drilled.message
    # Out of memory: stopped by its rule, whoever triggered it.
    oom = DATA / "oom" / "oom_optimizer_step_colossalai_issue3509.log"
    stopped = recovery_run(profile=profile, logs=[str(oom)], return_state=True)
    assert stopped.is_failed() and "stop rule: out-of-memory" in stopped.message
    bodies = receiver.wait(before + 2)[before:]
    assert [b["subject"] for b in bodies] == [
        "ckptops notified: restore drill from shared failed",
        "ckptops notified: recovery stopped",
    ]
    assert "FAIL drill from shared" in bodies[0]["text"] and "out-of-memory" in bodies[1]["text"]

    missing = write(
        tmp_path,
        {
            "job": job,
            "recovery": {"launcher": "local", "script": str(tmp_path / "job.sh")},
            "notify": {"block": "custom-webhook/absent"},
        },
        "missing.yaml",
    )
    # The same failure again: recovered again only when asked (retry), as an operator would.
    still = recovery_run(profile=missing, logs=[str(oom)], retry=True, return_state=True)
    assert still.is_failed() and "stop rule: out-of-memory" in still.message
    assert "notification not sent: block 'custom-webhook/absent'" in still.message
    assert len(receiver.bodies) == before + 2


def test_a_recovery_waiting_for_approval_is_announced_by_the_servers_automation(receiver, save_dir, tmp_path):
    """The approval notice lives on the server: a paused run of the recovery deployment makes it
    post to the block, with the run's UI link."""
    from prefect import get_client
    from prefect.deployments import run_deployment
    from prefect.flow_engine import run_flow
    from prefect.flow_runs import resume_flow_run

    from flows.recovery_run import recovery_run
    from tasks.profile import load_profile
    from tasks.recovery.automation import install

    shutil.rmtree(iter_dir(save_dir, 24))
    script = write_job_script(tmp_path / "job.sh", save_dir, tmp_path / "records.jsonl", train_iters=24)
    profile = write(
        tmp_path,
        {
            "job": {"name": "approve-me", "save_dir": str(save_dir), "layout": {"data_parallel": 2}},
            "verify": {"settle_seconds": 0},
            "recovery": {
                "launcher": "local",
                "script": str(script),
                "approval_timeout_seconds": 120,
            },
            "notify": {"block": "custom-webhook/test-pager"},
        },
    )
    deployment_id = recovery_run.to_deployment(name="approve-me-recovery").apply()
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(deployment_id)
    made = install(load_profile(profile), "recovery-run/approve-me-recovery")
    assert [a.name for a in made] == [
        "ckptops recovery storm approve-me",
        "ckptops recovery approval approve-me",
    ]
    before = len(receiver.bodies)
    log = DATA / "hardware" / "ecc_uncorrectable_nccl_watchdog_rank1_2xh100_sdscripts_issue1434.log"
    # The run goes through the deployment (so its Paused event names it) but runs here, in this
    # process, standing in for a worker.
    run = run_deployment(
        deployment.id, parameters={"profile": profile, "logs": [str(log)], "mode": "ask"}, timeout=0
    )

    def answer_once_notified():
        if len(receiver.wait(before + 1, timeout=120)) > before:
            resume_flow_run(run.id, run_input={"decision": "abort", "checkpoint": None, "note": "seen"})

    threading.Thread(target=contextvars.copy_context().run, args=(answer_once_notified,), daemon=True).start()
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(run.id)
    state = run_flow(recovery_run, flow_run=flow_run, parameters=flow_run.parameters, return_type="state")
    body = receiver.bodies[before]
    assert body["subject"] == "ckptops approve-me: a recovery waits for your approval"
    assert f"/runs/flow-run/{run.id}" in body["text"] and flow_run.name in body["text"]
    assert state.is_failed() and "not approved" in state.message


def test_a_stalled_save_fails_verify_and_promote_and_is_notified_once(receiver, save_dir, tmp_path):
    """The newest save stopped writing half-way (no metadata, rank 1's shard missing, nothing
    written for two minutes): verify-and-promote promotes the newest complete checkpoint, fails
    with the alarm, and tells a person once; the next run fails again without telling again."""
    import os
    import re
    import time

    from flows.verify_and_promote import verify_and_promote

    for iteration in (4, 8, 12, 16):  # one complete checkpoint to verify is enough here
        shutil.rmtree(iter_dir(save_dir, iteration))
    newest = iter_dir(save_dir, 24)
    for name in (".metadata", "metadata.json", "integrity.json", "__1_0.distcp"):
        (newest / name).unlink(missing_ok=True)
    (save_dir / "latest_checkpointed_iteration.txt").write_text("20")
    for path in newest.iterdir():
        os.utime(path, (time.time() - 120, time.time() - 120))
    job = {"name": "stalls", "save_dir": str(save_dir), "layout": {"data_parallel": 2}}
    verify = {"save_stall_seconds": 60, "wait_timeout_seconds": 0, "lock_timeout_seconds": 30}
    profile = write(
        tmp_path, {"job": job, "verify": verify, "notify": {"block": "custom-webhook/test-pager"}}
    )
    before = len(receiver.bodies)
    first = verify_and_promote(profile=profile, return_state=True)
    assert first.is_failed()
    idle = re.search(
        r"ALERT save iter_0000024 stalled: no byte written for (\d+) s \(threshold 60 s\)", first.message
    )
    assert idle and int(idle[1]) >= 120, first.message
    assert "no shard from rank(s) 1" in first.message
    assert (save_dir / "latest_verified_iteration.txt").read_text().strip() == "20"
    (body,) = receiver.wait(before + 1)[before:]
    assert body["subject"] == "ckptops stalls: a checkpoint save needs a person"
    assert body["text"].startswith("[stalls] ALERT save iter_0000024 stalled")
    second = verify_and_promote(profile=profile, return_state=True)
    assert second.is_failed() and "ALERT save iter_0000024 stalled" in second.message
    assert len(receiver.bodies) == before + 1
