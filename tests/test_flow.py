"""The verify-and-promote flow against a real Prefect server (its deployments and trigger are
checked in make demo's test, tests/test_demo.py)."""

import json
from datetime import UTC, datetime

from prefect.artifacts import Artifact
from prefect.client.orchestration import get_client

from flows.verify_and_promote import verify_and_promote
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.pointer import read_pointer
from tasks.events import CHECKPOINT_PROMOTED, job_resource
from tests.conftest import flip_byte, iter_dir
from tests.helpers.poll import within
from tests.test_verify import tensor_data_offset


def write_profile(tmp_path, save_dir, name="flow-test", lock_timeout=30):
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"job: {{name: {name}, save_dir: {save_dir}, megatron_core_version: '0.19.2',"
        f" layout: {{data_parallel: 2}}}}\n"
        f"verify: {{wait_timeout_seconds: 0, poll_seconds: 1, lock_timeout_seconds: {lock_timeout}}}\n"
        "retention: {keep_verified: 3}\n"
    )
    return str(path)


def test_flow_verifies_promotes_retains_and_publishes(prefect_api, save_dir, tmp_path):
    started = datetime.now(UTC)
    state = verify_and_promote(profile=write_profile(tmp_path, save_dir), return_state=True)
    assert state.is_completed(), state.message
    assert state.message == (
        "verified 4, 8, 12, 16, 20, 24; latest verified: 24 (first promotion); retention deleted 4, 8, 12"
    )
    assert read_pointer(save_dir) == 24
    assert sorted(p.name for p in save_dir.glob("iter_*")) == ["iter_0000016", "iter_0000020", "iter_0000024"]

    table = Artifact.get("verify-checks-flow-test")
    rows = json.loads(table.data)
    assert {r["iteration"] for r in rows} == {4, 8, 12, 16, 20, 24}
    assert all(r["result"] == "pass" for r in rows)
    summary = Artifact.get("verify-summary-flow-test").data
    assert "latest verified: **24** (was None; first promotion)" in summary
    assert "Totals: 6 checkpoints" in summary and "deleted [4, 8, 12]" in summary

    again = verify_and_promote(profile=write_profile(tmp_path, save_dir), return_state=True)
    assert again.is_completed() and again.message == "latest verified: 24 (already the newest verified)"
    # Each run that leaves the pointer on the newest complete checkpoint tells the promotion
    # alarm so (the server stores events asynchronously: a bounded poll).
    assert promoted_events("flow-test", started, 2) == [24, 24]


def promoted_events(job: str, since: datetime, count: int, timeout: float = 60) -> list[int]:
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    with get_client(sync_client=True) as client:

        def found() -> list[int]:
            page = client.read_events(
                filter=EventFilter(
                    occurred=EventOccurredFilter(since=since),
                    event=EventNameFilter(name=[CHECKPOINT_PROMOTED]),
                    resource=EventResourceFilter(id=[job_resource(job)]),
                ),
                limit=50,
            )
            return [e.payload["iteration"] for e in page.events]

        return (
            within(lambda: (events := found()) and len(events) >= count and events, timeout, 0.5) or found()
        )


def test_flow_fails_naming_the_bad_checkpoint_and_keeps_the_good_one(prefect_api, save_dir, tmp_path):
    directory = iter_dir(save_dir, 24)
    flip_byte(directory / "__0_0.distcp", tensor_data_offset(directory, "__0_0.distcp"))
    state = verify_and_promote(profile=write_profile(tmp_path, save_dir, "flow-bad"), return_state=True)
    assert state.is_failed()
    assert state.message.startswith("INVALID iter_0000024: __0_0.distcp: ") and "[crc]" in state.message
    # Megatron-LM's own tracker still names 24: a plain --load would take it (issue 56).
    tracker = save_dir / "latest_checkpointed_iteration.txt"
    assert f"ALERT {tracker} names iteration 24, which is invalid (__0_0.distcp: " in state.message
    assert read_pointer(save_dir) == 20
    rows = json.loads(Artifact.get("verify-checks-flow-bad").data)
    assert any(r["iteration"] == 24 and r["result"] == "FAIL" and r["file"] == "__0_0.distcp" for r in rows)


def test_flow_removes_the_pointer_when_nothing_valid_is_left(prefect_api, save_dir, tmp_path):
    profile = write_profile(tmp_path, save_dir, "flow-none")
    assert verify_and_promote(profile=profile, return_state=True).is_completed()
    for path in save_dir.glob("iter_*/__1_0.distcp"):
        path.unlink()
        (path.parent / "manifest.json").unlink()  # as if never verified: judged afresh
    state = verify_and_promote(profile=profile, return_state=True)
    assert state.is_failed() and "pointer removed: no valid checkpoint left" in state.message
    assert read_pointer(save_dir) is None


def test_flow_does_not_run_while_another_run_holds_the_job(prefect_api, save_dir, tmp_path):
    profile = write_profile(tmp_path, save_dir, "flow-locked", lock_timeout=0)
    with job_lock(save_dir, 0):
        state = verify_and_promote(profile=profile, return_state=True)
    assert state.is_failed() and ".ckptops.lock: held by pid" in state.message
    assert read_pointer(save_dir) is None
    assert not list(save_dir.glob("iter_*/manifest.json"))


def test_archive_and_drill_flows_publish_their_results(prefect_api, save_dir, tmp_path):
    from flows.archive_copy import archive_copy
    from flows.restore_drill import restore_drill
    from tests.conftest import write_job_profile

    profile = str(write_job_profile(tmp_path, save_dir, str(tmp_path / "archive")))
    assert verify_and_promote(profile=profile, return_state=True).is_completed()
    archived = archive_copy(profile=profile, return_state=True)
    assert archived.is_completed() and archived.message == "iteration 24: committed"
    assert "read every object back" in Artifact.get("archive-test-job").data

    for source in ("shared", "archive"):
        state = restore_drill(profile=profile, source=source, return_state=True)
        assert state.is_completed(), state.message
        assert state.message.startswith(f"PASS drill from {source}, iteration 24")
        phases = json.loads(Artifact.get(f"drill-{source}-test-job").data)
        assert [r["phase"] for r in phases[:4]] == [
            "download" if source == "archive" else "copy",
            "verify",
            "load",
            "restore window",
        ]
    history = json.loads(Artifact.get("drill-history-test-job").data)
    assert [r["source"] for r in history] == ["shared", "archive"]
    assert "data:image/png;base64," in Artifact.get("drill-trend-test-job").data

    over_budget = str(write_job_profile(tmp_path, save_dir, str(tmp_path / "archive"), budget=0.001))
    failed = restore_drill(profile=over_budget, source="shared", return_state=True)
    assert failed.is_failed() and "over the 0.001s budget" in failed.message
