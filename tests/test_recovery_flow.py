"""The recovery-run flow on a real Prefect server, from logs (no Slurm): an approval nobody gives
aborts, a numerical failure rolls back to the checkpoint before the anomaly and shows it on the
approval form, an approver's "abort" relaunches nothing; and the CLI's triage and incidents."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from infra.local_job.launch import run_local_job, write_job_script
from tasks.cluster.process import Failed
from tasks.recovery.ledger import incidents
from tests.helpers.approver import answer_when_paused
from tests.test_cli import CKPTOPS, ckptops

DATA = Path(__file__).parent / "data" / "triage"


def failed_run(root: Path, extra: list[str], train_iters: int) -> tuple[Path, Path, Path]:
    """A local job run to its failure (or, for a silent NaN, to its end): save dir, records, log."""
    save, records = root / "checkpoints", root / "records.jsonl"
    try:
        log = run_local_job(
            save,
            train_iters=train_iters,
            save_interval=2,
            timeout_seconds=600,
            extra=["--step-records", str(records), *extra],
        )
    except Failed as e:
        log = e.log
    return save, records, log


@pytest.fixture(scope="module")
def ecc_run(tmp_path_factory):
    return failed_run(tmp_path_factory.mktemp("ecc"), ["--fail-at", "1:6:ecc"], 8)


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """Rank 1's weights turn NaN before iteration 5 and, with Megatron's NaN check off, the job
    trains on and saves NaN checkpoints at 6 and 8 (whole bytes, every CRC right)."""
    return failed_run(
        tmp_path_factory.mktemp("nan"),
        ["--fail-at", "1:5:nan", "--no-check-for-nan-in-loss-and-grad"],
        8,
    )


def profile_for(run, tmp_path: Path, **recovery) -> Path:
    save, records, _ = run
    copy = shutil.copytree(save, tmp_path / "checkpoints")
    shutil.copy(records, tmp_path / "records.jsonl")
    script = write_job_script(tmp_path / "job.sh", copy, tmp_path / "records.jsonl", train_iters=8)
    path = tmp_path / "profile.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "job": {"name": "flowjob", "save_dir": str(copy), "layout": {"data_parallel": 2}},
                "verify": {"settle_seconds": 0},
                "recovery": {
                    "launcher": "local",
                    "script": str(script),
                    "step_records": str(tmp_path / "records.jsonl"),
                    "log_dir": str(tmp_path / "logs"),
                    **recovery,
                },
            }
        )
    )
    return path


def test_an_approval_nobody_gives_aborts_and_relaunches_nothing(prefect_api, ecc_run, tmp_path):
    from flows.recovery_run import recovery_run

    profile = profile_for(ecc_run, tmp_path, approval_timeout_seconds=3)
    state = recovery_run(profile=str(profile), logs=[str(ecc_run[2])], mode="ask", return_state=True)
    assert state.is_failed()
    (incident,) = incidents(tmp_path / "checkpoints")
    assert incident.outcome == "aborted" and "no answer within" in incident.reason
    assert incident.relaunched_job is None and "approved" not in incident.times
    assert incident.cls == "hardware" and incident.failure_iteration == 5


def test_numerics_rolls_back_before_the_anomaly_and_an_abort_relaunches_nothing(
    prefect_api, nan_run, tmp_path
):
    from flows.recovery_run import recovery_run

    profile = profile_for(nan_run, tmp_path)
    # An earlier continuation drill certified 2 (recorded as a drill records it).
    from tasks.checkpoint.lock import job_lock
    from tasks.checkpoint.state import VerifyOptions
    from tasks.checkpoint.verify import record_certification, verify_and_record
    from tasks.profile import load_profile

    two = tmp_path / "checkpoints" / "iter_0000002"
    options = VerifyOptions.from_profile(load_profile(profile), two.parent)
    with job_lock(two.parent, 10) as held:
        verified = verify_and_record(two, options, held)
        record = {"ok": True, "drill": "shared-test", "steps": 2, "detail": "iterations 3-4 match"}
        assert record_certification(two, verified.manifest.files, record, held, options.trust)
    seen: dict = {}
    waiter = answer_when_paused({"decision": "abort", "checkpoint": None, "note": "data first"}, seen)
    state = recovery_run(profile=str(profile), logs=[str(nan_run[2])], mode="ask", return_state=True)
    seen["done"] = True
    waiter.join(timeout=30)
    assert state.is_failed()
    (incident,) = incidents(tmp_path / "checkpoints")
    assert incident.cls == "numerics" and incident.outcome == "aborted" and "data first" in incident.reason
    # 6 and 8 have whole bytes but NaN weights: verification refuses them (values), so the newest
    # promoted is 4, and the plan is 4, before the anomaly at iteration 5.
    assert incident.promoted_at_failure == 4
    assert "checkpoint: **4** (verified candidates: 4, 2)" in seen["form"]
    assert "- 4: no continuation drill" in seen["form"]
    assert "- 2: certified (its continuation drill went on as the original run did)" in seen["form"]
    assert "**2 is certified, 4 is not**: approve with checkpoint 2" in seen["form"]
    assert incident.relaunched_job is None


def test_triage_cli_prints_the_class_first_and_json_and_fails_on_unreadable(tmp_path):
    log = DATA / "hardware" / "ecc_uncorrectable_nccl_watchdog_rank1_2xh100_sdscripts_issue1434.log"
    text = ckptops("triage", log)
    assert text.returncode == 0 and text.stdout.split()[0] == "hardware"
    data = json.loads(ckptops("triage", "--json", log).stdout)
    assert {"class", "suspect_nodes", "first_error", "evidence"} <= set(data)
    assert set(data["first_error"]) == {"file", "line", "text"}
    empty = tmp_path / "empty.log"
    empty.write_text("")
    assert ckptops("triage", empty).stdout.startswith("unknown")
    missing = ckptops("triage", tmp_path / "absent.log")
    assert missing.returncode == 2 and str(tmp_path / "absent.log") in missing.stderr
    assert "Traceback" not in missing.stderr


def test_recover_cli_without_a_source_or_a_terminal_does_nothing(ecc_run, tmp_path):
    profile = profile_for(ecc_run, tmp_path)
    assert ckptops("recover", "--profile", profile).returncode == 2
    # Not auto-approved, no --approve, and stdin is not a terminal: nobody can say yes.
    done = subprocess.run(
        [str(CKPTOPS), "recover", "--logs", str(ecc_run[2]), "--profile", str(profile)],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1 and done.stdout.startswith("aborted")
    assert "no terminal to ask and no --approve" in done.stdout
    listed = ckptops("incidents", "--profile", profile, "--json")
    assert [i["outcome"] for i in json.loads(listed.stdout)] == ["aborted"]
