"""A pipeline that cannot wedge, on a real Prefect server with a real process worker: a worker
killed while it submits a verify-and-promote run (the run stays PENDING holding the deployment's
only slot) no longer stops every later run; a host that knows its worker is gone crashes the
orphans at once; the promotion alarm tells a person when saves go unpromoted, and ``status``
shows it; a flow run of a failure another recovery has in hand ends Cancelled."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

from tasks.checkpoint.pointer import read_pointer
from tests.conftest import ROOT, iter_dir
from tests.helpers.events import post_saved
from tests.helpers.poll import until
from tests.test_cli import ckptops_here
from tests.test_notify import receiver  # noqa: F401  (a fixture)

VERIFY = "flows/verify_and_promote.py:verify_and_promote"


def profile_for(tmp_path: Path, save: Path, name: str = "wedge", **extra) -> Path:
    path = tmp_path / f"{name}.yaml"
    data = {
        "job": {"name": name, "save_dir": str(save), "layout": {"data_parallel": 2}},
        "verify": {"settle_seconds": 0, "lock_timeout_seconds": 30, "wait_timeout_seconds": 0},
        "prefect": {"submission_timeout_seconds": 20},
    }
    for section, values in extra.items():
        data[section] = {**data.get(section, {}), **values}
    path.write_text(yaml.safe_dump(data))
    return path


def deployment(client, pool: str, name: str, profile: Path):
    """A process work pool and a verify-and-promote deployment in it, one run at a time
    (limit 1, ENQUEUE, as infra/prefect.yaml has it), tagged ckptops."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy, ConcurrencyOptions
    from prefect.workers.process import ProcessWorker

    client.create_work_pool(
        WorkPoolCreate(
            name=pool, type="process", base_job_template=ProcessWorker.get_default_base_job_template()
        ),
        overwrite=True,
    )
    flow_id = client.create_flow_from_name("verify-and-promote")
    return client.create_deployment(
        flow_id=flow_id,
        name=name,
        work_pool_name=pool,
        entrypoint=VERIFY,
        path=str(ROOT),
        parameters={"profile": str(profile)},
        tags=["ckptops", "wedge"],
        concurrency_limit=1,
        concurrency_options=ConcurrencyOptions(collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
        pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}],
    )


def start_worker(pool: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--limit", "2"],
            cwd=ROOT,
            env={**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1"},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill(worker: subprocess.Popen) -> None:
    """SIGKILL the worker and everything it started, as a host that goes away would."""
    children = psutil.Process(worker.pid).children(recursive=True)
    os.killpg(worker.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    worker.wait(timeout=30)


def state_of(client, run_id):
    return client.read_flow_run(run_id).state


def test_a_dead_worker_does_not_wedge_verify_and_promote(prefect_api, trained, tmp_path):
    """A worker SIGKILLed while it submits one run (PENDING, its engine not started yet) and
    while another runs (RUNNING, waiting for a save in progress): the watchdog crashes both, the
    first after prefect.submission_timeout_seconds, the second after prefect.silent_run_seconds
    without a heartbeat, which gives their deployments' slots back; the next saved checkpoint is
    promoted by a new worker. Before, the next run bounced back to SCHEDULED for good."""
    from prefect import get_client

    from tasks.profile import load_profile
    from tasks.watchdog import install

    save = shutil.copytree(trained, tmp_path / "checkpoints")
    waiting = shutil.copytree(trained, tmp_path / "waiting")
    (iter_dir(waiting, 24) / "metadata.json").unlink()  # a save still being written: the run waits
    profile = profile_for(tmp_path, save, prefect={"silent_run_seconds": 35})
    pool = f"wedge-{tmp_path.name[-8:].lower().replace('_', '-')}"
    watching = install(load_profile(profile))
    with get_client(sync_client=True) as client:
        dep = deployment(client, pool, "wedge", profile)
        silent = deployment(client, pool, "silent", profile_for(tmp_path, waiting, "silent"))
        worker = start_worker(pool, tmp_path / "worker.log")
        try:
            # The engine would start 30 s after the submission; the worker dies before.
            late = f"sh -c 'sleep 30; exec {sys.executable} -m prefect.engine'"
            stuck = client.create_flow_run_from_deployment(dep, job_variables={"command": late})
            beating = client.create_flow_run_from_deployment(
                silent,
                parameters={"wait_timeout_seconds": 600},
                job_variables={"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}},
            )
            until(lambda: state_of(client, stuck.id).is_pending(), 120, "the worker took the first run")
            until(lambda: state_of(client, beating.id).is_running(), 120, "the second run started")
            kill(worker)
            worker = start_worker(pool, tmp_path / "worker.log")
            promoted = client.create_flow_run_from_deployment(dep)
            until(lambda: state_of(client, promoted.id).is_final(), 240, "the next run finished")
            assert state_of(client, promoted.id).is_completed(), state_of(client, promoted.id).message
            assert read_pointer(save) == 24
            crashed = state_of(client, stuck.id)
            assert crashed.is_crashed() and "pending for 20 s without starting" in crashed.message
            until(lambda: state_of(client, beating.id).is_crashed(), 120, "the silent run was crashed")
            assert "no heartbeat for 35 s" in state_of(client, beating.id).message
            assert client.read_deployment(silent).global_concurrency_limit.active_slots == 0
        finally:
            kill(worker)
            for automation in watching:
                client.delete_automation(automation.id)


def test_a_host_whose_worker_is_gone_crashes_its_orphans_at_once(prefect_api, trained, tmp_path):
    """What make demo does before it starts a worker in place of a dead one: one run left
    PENDING (its submission never started), one RUNNING (waiting for a save still in progress)."""
    from prefect import get_client

    from tasks.watchdog import crash_orphans

    save = shutil.copytree(trained, tmp_path / "checkpoints")
    (iter_dir(save, 24) / "metadata.json").unlink()  # a save still being written: the run waits
    profile = profile_for(tmp_path, save)
    pool = f"orphans-{tmp_path.name[-8:].lower().replace('_', '-')}"
    with get_client(sync_client=True) as client:
        pending = deployment(client, pool, "orphans-pending", profile)
        running = deployment(client, pool, "orphans-running", profile)
        worker = start_worker(pool, tmp_path / "worker.log")
        try:
            stuck = client.create_flow_run_from_deployment(pending, job_variables={"command": "sleep 600"})
            waiting = client.create_flow_run_from_deployment(
                running, parameters={"wait_timeout_seconds": 600}
            )
            until(lambda: state_of(client, stuck.id).is_pending(), 120, "the worker took the first run")
            until(lambda: state_of(client, waiting.id).is_running(), 120, "the second run started")
        finally:
            kill(worker)
        assert sorted(crash_orphans(pool, "its worker is gone")) == sorted([stuck.name, waiting.name])
        assert state_of(client, stuck.id).is_crashed() and state_of(client, waiting.id).is_crashed()
        for dep in (pending, running):
            limit = client.read_deployment(dep).global_concurrency_limit
            assert limit.active_slots == 0, "a crashed run still holds its deployment's slot"


def test_status_raises_the_alarm_for_a_complete_checkpoint_left_unpromoted(save_dir, tmp_path):
    profile = profile_for(tmp_path, save_dir, verify={"alert_after_seconds": 600})
    assert ckptops_here("promote", save_dir, "--iteration", "20", "--profile", profile).exit_code == 0

    def saved(seconds_ago: float) -> None:
        at = time.time() - seconds_ago
        for path in iter_dir(save_dir, 24).iterdir():
            os.utime(path, (at, at))

    saved(60)  # iter 24 finished saving a minute ago: not late yet
    quiet = ckptops_here("status", "--profile", profile)
    assert quiet.exit_code == 0 and "ALERT" not in quiet.stdout
    saved(3600)  # an hour ago, and never promoted (20 was, by hand)
    late = ckptops_here("status", "--profile", profile)
    assert late.exit_code == 1
    assert late.stdout.strip().splitlines()[-1] == (
        "ALERT iter_0000024: complete for 60 min and not promoted; the pointer is at 20; "
        "verify.alert_after_seconds is 600 (configured): is verify-and-promote running?"
    )


def test_the_promotion_alarm_notifies_when_a_save_is_not_promoted_in_time(prefect_api, receiver, tmp_path):  # noqa: F811
    from tasks.profile import load_profile
    from tasks.watchdog import install, overdue_name

    save = tmp_path / "checkpoints"
    save.mkdir()
    profile = profile_for(
        tmp_path, save, verify={"alert_after_seconds": 10}, notify={"block": "custom-webhook/test-pager"}
    )
    made = install(load_profile(profile))
    assert overdue_name("wedge") in [a.name for a in made]
    before = len(receiver.bodies)

    try:
        # Prefect's triggers service (SQLite) loads new automations on its next 5 s pass; a save
        # it saw before then is not watched. The job saves again, as a job does, until it is.
        deadline = time.monotonic() + 90
        bodies = receiver.bodies
        while len(bodies) <= before and time.monotonic() < deadline:
            post_saved(prefect_api, "wedge", 12)
            bodies = receiver.wait(before + 1, timeout=20)
        assert len(bodies) > before, "no notification"
        assert bodies[-1]["subject"] == "ckptops wedge: a checkpoint was not promoted in time"
        assert "is verify-and-promote running?" in bodies[-1]["text"]
    finally:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            for automation in made:
                client.delete_automation(automation.id)


def test_the_alarm_installed_before_any_save_follows_the_interval_the_saves_show(
    prefect_api,
    receiver,  # noqa: F811
    trained,
    tmp_path,
):
    from tasks.checkpoint.catalog import catalog
    from tasks.checkpoint.overdue import MIN_ALERT_SECONDS, UNMEASURED_ALERT_SECONDS
    from tasks.checkpoint.state import VerifyOptions
    from tasks.profile import load_profile
    from tasks.watchdog import install, overdue_name, refresh_alarm

    save = tmp_path / "checkpoints"
    save.mkdir()
    path = profile_for(tmp_path, save, "early", notify={"block": "custom-webhook/test-pager"})
    profile = load_profile(path)
    made = install(profile)
    (early,) = [a for a in made if a.name == overdue_name("early")]
    assert early.trigger.within.total_seconds() == UNMEASURED_ALERT_SECONDS
    # The job saves (every few seconds here): the next verify-and-promote run refreshes it.
    shutil.rmtree(save)
    shutil.copytree(trained, save)
    refreshed = refresh_alarm(profile, catalog(save, VerifyOptions.from_profile(profile)))
    try:
        assert refreshed is not None and refreshed.trigger.within.total_seconds() == MIN_ALERT_SECONDS
        assert refresh_alarm(profile, catalog(save, VerifyOptions.from_profile(profile))) is None
    finally:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            for automation in made:
                for each in client.read_automations_by_name(name=automation.name):
                    client.delete_automation(each.id)


def test_a_flow_run_for_a_failure_another_recovery_has_in_hand_ends_cancelled(prefect_api, tmp_path):
    """The Prefect deployment's limit does not cover the CLI: the flow takes the same recovery
    lock, and a failure another recovery holds ends the run Cancelled, nothing relaunched."""
    from flows.recovery_run import recovery_run
    from tasks.checkpoint import layout
    from tasks.checkpoint.lock import job_lock
    from tasks.recovery.ledger import Incident, incidents, record
    from tasks.recovery.run import Source, failure_key
    from tasks.recovery.triage import triage
    from tests.test_recovery import HARDWARE_LOG, local_profile

    profile = local_profile(tmp_path)
    save = tmp_path / "checkpoints"
    holder = Incident("20261201-0000-held", "job", "cli", outcome="running")
    holder.failure_key = failure_key(Source(logs=[HARDWARE_LOG]), triage([HARDWARE_LOG]))
    record(save, holder)
    with job_lock(save, 0, layout.RECOVERY_LOCK):
        state = recovery_run(profile=str(profile), logs=[str(HARDWARE_LOG)], return_state=True)
    assert state.is_cancelled() and "incident 20261201-0000-held is recovering this failure" in state.message
    assert [i.id for i in incidents(save)] == [holder.id]
