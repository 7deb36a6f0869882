"""Recovery as an unlucky operator meets it: the same failure recovered five times at once, a
recovery killed with SIGKILL or ended with SIGTERM after its relaunch, a relaunch that makes no
progress, a checkpoint that rotted after promotion. Every case runs the local job from its own
batch script and ``ckptops recover`` as a process, killed with real signals."""

import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from infra.local_job.launch import write_job_script
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.pins import pins
from tasks.checkpoint.pointer import read_pointer
from tasks.cluster import process
from tasks.recovery.ledger import incidents, ledger_path
from tasks.storage.local import read_jsonl
from tests.conftest import ROOT, flip_byte, free_port, iter_dir
from tests.helpers.poll import until
from tests.test_cli import CKPTOPS

FAULT = "1:10:ecc"  # rank 1 dies before iteration 10: checkpoints 4 and 8, the last step 9
TRAIN_ITERS = 40
SLOW_MS = 200  # each step: long enough that a relaunch still trains while a recovery restarts


@dataclass
class Job:
    root: Path
    save: Path
    records: Path
    script: Path
    log: Path
    profile: Path


def _script(root: Path, save: Path, records: Path, extra: tuple[str, ...] = ()) -> Path:
    return write_job_script(
        root / "job.sh",
        save,
        records,
        job_name="safe",
        port=free_port(),
        train_iters=TRAIN_ITERS,
        save_interval=4,
        extra=["--slow-step-ms", str(SLOW_MS), *extra],
    )


@pytest.fixture(scope="module")
def failed(tmp_path_factory) -> Job:
    """The local job run from its batch script to its rehearsed failure, once for the module."""
    root = tmp_path_factory.mktemp("failed")
    save, records = root / "checkpoints", root / "records.jsonl"
    script, log = _script(root, save, records), root / "train.out"
    job = process.start(["bash", str(script)], log, {**os.environ, "CKPTOPS_FAIL_AT": FAULT})
    with pytest.raises(process.Failed):
        process.wait(job, log, 600, "the failing job")
    return Job(root, save, records, script, log, Path())


def job_copy(failed: Job, tmp_path: Path, extra: tuple[str, ...] = (), **recovery) -> Job:
    """A private copy of the failed job (checkpoints, records, log) with its script (``extra``:
    flags the script adds since the failure) and profile."""
    save = shutil.copytree(failed.save, tmp_path / "checkpoints")
    records = Path(shutil.copy(failed.records, tmp_path / "records.jsonl"))
    log = Path(shutil.copy(failed.log, tmp_path / "train.out"))
    script = _script(tmp_path, save, records, extra)
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        yaml.safe_dump(
            {
                "job": {"name": "safe", "save_dir": str(save), "layout": {"data_parallel": 2}},
                "verify": {"settle_seconds": 0, "lock_timeout_seconds": 60},
                "resume": {
                    "warmup_steps": 2,
                    "min_steps": 4,
                    "loss_rel_tolerance": 0.0,
                    "memory_band": 0.5,
                    "throughput_drop": 0.9,
                },
                "recovery": {
                    "launcher": "local",
                    "script": str(script),
                    "step_records": str(records),
                    "log_dir": str(tmp_path / "logs"),
                    "progress_steps": 6,
                    "progress_timeout_seconds": 300,
                    **recovery,
                },
            }
        )
    )
    return Job(tmp_path, save, records, script, log, profile)


def recover(job: Job, *extra: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """``ckptops recover`` of the job's failure (or the one ``log`` shows), approved."""
    return subprocess.Popen(
        [
            str(CKPTOPS),
            "recover",
            "--logs",
            str(log or job.log),
            "--approve",
            "--json",
            "--profile",
            str(job.profile),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def ledger_lines(job: Job) -> list[dict]:
    """The ledger's whole lines: one the recovery is appending while this reads is skipped."""
    return read_jsonl(ledger_path(job.save))


def relaunched(job: Job) -> str | None:
    return next((line["relaunched_job"] for line in ledger_lines(job) if line.get("relaunched_job")), None)


def local_pid(job_id: str) -> int:
    return int(job_id.split(":", 1)[1])


def processes_of(path: Path) -> list[psutil.Process]:
    """Live processes whose command line names ``path`` (the job's script or save directory)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and str(path) in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


def stop_job(job_id: str | None) -> None:
    if job_id:
        process.terminate(local_pid(job_id), grace_seconds=5)


def test_five_recoveries_of_one_failure_started_together_relaunch_once(failed, tmp_path):
    job = job_copy(failed, tmp_path, max_per_hour=3)
    runs = [recover(job) for _ in range(5)]
    try:
        done = [(run.wait(timeout=600), *run.communicate()) for run in runs]
        codes = sorted(code for code, _, _ in done)
        assert codes == [0, 3, 3, 3, 3], [(c, e[-300:]) for c, _, e in done]
        (incident,) = incidents(job.save)
        assert incident.outcome == "completed" and incident.checkpoint == 8
        for code, _, stderr in done:
            if code == 3:
                assert f"incident {incident.id}" in stderr and "nothing relaunched" in stderr
        # One relaunch: every ledger line of the one incident names the same job, or none yet.
        assert {line["relaunched_job"] for line in ledger_lines(job)} == {None, incident.relaunched_job}
        assert {line["id"] for line in ledger_lines(job)} == {incident.id}
    finally:
        stop_job(relaunched(job))


def test_a_recovery_killed_after_its_relaunch_is_adopted_not_relaunched_again(failed, tmp_path):
    job = job_copy(failed, tmp_path)
    first = recover(job)
    new = None
    try:
        new = until(lambda: relaunched(job), 300, "the first recovery relaunched the job")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        (left,) = incidents(job.save)
        assert left.outcome == "running" and left.relaunched_job == new
        assert process.running(local_pid(new), left.relaunch_process), "the relaunch died with its recovery"
        second = recover(job)
        out, err = second.communicate(timeout=600)
        assert second.returncode == 0, err[-2000:]
        adopted = json.loads(out)
        assert adopted["id"] == left.id and adopted["relaunched_job"] == new
        assert adopted["outcome"] == "completed" and adopted["reason"].startswith("adopted after")
        assert adopted["validation"].startswith("VALIDATED")
        # Nothing relaunched a second time: one job id in the whole ledger.
        assert {line["relaunched_job"] for line in ledger_lines(job)} - {None} == {new}
        assert len(processes_of(job.script)) <= 1
    finally:
        stop_job(new or relaunched(job))


def test_sigterm_closes_the_incident_as_interrupted_with_the_relaunch_named(failed, tmp_path):
    job = job_copy(failed, tmp_path)
    run = recover(job)
    new = None
    try:
        new = until(lambda: relaunched(job), 300, "the recovery relaunched the job")
        # Past Megatron-LM's printed arguments (read from the relaunch's output) and training:
        # the recovery waits for its progress.
        before = len(job.records.read_text().splitlines())
        until(lambda: ledger_lines(job)[-1].get("printed_args"), 120, "the relaunch's arguments read")
        until(lambda: len(job.records.read_text().splitlines()) > before, 120, "the relaunch trains")
        os.killpg(run.pid, signal.SIGTERM)
        out, err = run.communicate(timeout=60)
        # 128 + 15, no traceback, and the incident as it was closed on stdout.
        assert run.returncode == 143 and "Traceback" not in err, err[-2000:]
        assert json.loads(out)["outcome"] == "interrupted"
        (incident,) = incidents(job.save)
        assert incident.outcome == "interrupted"
        assert incident.reason.startswith("interrupted by SIGTERM during wait-progress; relaunched " + new)
        # The relaunch was left running for the next recovery to adopt, not killed with the run.
        assert process.running(local_pid(new), incident.relaunch_process)
    finally:
        stop_job(new or relaunched(job))


def test_a_relaunch_that_makes_no_progress_is_cancelled_before_the_incident_stops(failed, tmp_path):
    job = job_copy(failed, tmp_path, progress_timeout_seconds=12)
    # The relaunch inherits a hang: rank 0 stops before iteration 9, the first it would train.
    run = recover(job, env={"CKPTOPS_FAIL_AT": "0:9:hang"})
    out, err = run.communicate(timeout=600)
    new = json.loads(out)["relaunched_job"]
    try:
        assert run.returncode == 1, err[-2000:]
        (incident,) = incidents(job.save)
        assert incident.outcome == "stopped" and incident.relaunched_job == new
        assert "0 resumed steps after 12s, wanted 6" in incident.reason
        assert f"job {new} stopped" in incident.reason
        # Gone, with everything it started (torchrun and both ranks).
        assert not process.running(local_pid(new), incident.relaunch_process)
        assert not processes_of(job.save)
    finally:
        stop_job(new)


def test_a_checkpoint_that_rotted_after_promotion_is_not_relaunched_from(failed, tmp_path):
    """A byte flipped in the promoted checkpoint, file times kept: the re-verification before the
    relaunch finds it, marks it invalid, moves the pointer, and the plan is the one before."""
    job = job_copy(failed, tmp_path)
    assert (
        subprocess.run(
            [str(CKPTOPS), "promote", "--profile", str(job.profile)], capture_output=True, timeout=300
        ).returncode
        == 0
    )
    assert read_pointer(job.save) == 8
    flip_byte(iter_dir(job.save, 8) / "__0_0.distcp", 5000)
    # Nobody can approve (no terminal, no --approve): the run stops at the approval, after the choice.
    done = subprocess.run(
        [str(CKPTOPS), "recover", "--logs", str(job.log), "--json", "--profile", str(job.profile)],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
    )
    incident = json.loads(done.stdout)
    assert incident["outcome"] == "aborted" and incident["relaunched_job"] is None
    first, second = incident["reverified"]
    assert (first["iteration"], first["outcome"], first["mode"]) == (8, "fail", "full")
    assert "[crc]" in first["reason"] and first["seconds"] >= 0
    assert (second["iteration"], second["outcome"]) == (4, "pass")
    assert "reverified" in incident["times"]
    assert read_pointer(job.save) == 4
    assert read_manifest(iter_dir(job.save, 8)).status == "invalid"
    verify = subprocess.run(
        [str(CKPTOPS), "verify", str(iter_dir(job.save, 8))], capture_output=True, text=True
    )
    assert verify.returncode == 1 and "[crc]" in verify.stdout


def test_a_relaunch_its_recovery_never_recorded_is_found_by_its_token_and_adopted(failed, tmp_path):
    """A recovery killed between submitting the relaunch and recording it leaves an incident that
    names only the relaunch's token (saved before the submission); the job carries the token in
    its environment, and the next recovery finds it there and adopts it instead of relaunching."""
    from tasks.checkpoint.promote import promote
    from tasks.checkpoint.state import VerifyOptions
    from tasks.profile import load_profile
    from tasks.recovery import job as jobs
    from tasks.recovery.ledger import Incident, record

    job = job_copy(failed, tmp_path)
    profile = load_profile(job.profile)
    promote(profile.job.save_dir, VerifyOptions.from_profile(profile), 30)  # as the killed one had
    settings = profile.recovery
    left = Incident("20261201-0000-kill", "safe", "cli", outcome="running", checkpoint=8)
    left.mark("detected")
    left.relaunch_token, left.records_before = left.id, len(job.records.read_text().splitlines())
    left.failure_iteration = 9
    record(job.save, left)
    new, _, _ = jobs.start_local(settings, "safe", 8, tmp_path / "logs", left.relaunch_token)
    try:
        done = recover(job)
        out, err = done.communicate(timeout=600)
        assert done.returncode == 0, out
        adopted = json.loads(out)
        assert adopted["id"] == left.id and adopted["relaunched_job"] == new
        assert adopted["outcome"] == "completed" and adopted["validation"].startswith("VALIDATED")
        assert [i.id for i in incidents(job.save)] == [left.id]
    finally:
        stop_job(new)


def test_the_checkpoint_an_approver_picks_is_verified_again_before_it_is_used(failed, tmp_path):
    from tasks.checkpoint.promote import promote
    from tasks.checkpoint.state import VerifyOptions
    from tasks.profile import load_profile
    from tasks.recovery.run import Decision, Source
    from tasks.recovery.run import recover as run_recovery

    job = job_copy(failed, tmp_path)
    promote(job.save, VerifyOptions.from_profile(load_profile(job.profile)), 30)
    flip_byte(iter_dir(job.save, 4) / "__1_0.distcp", 5000)  # after it was verified
    incident = run_recovery(
        load_profile(job.profile),
        Source(logs=[job.log]),
        "test",
        lambda plan: Decision(True, "an approver who prefers 4", checkpoint=4),
    )
    assert incident.outcome == "stopped" and incident.relaunched_job is None
    assert incident.reason == "checkpoint 4, the approver's choice, failed re-verification"
    assert [(r["iteration"], r["outcome"]) for r in incident.reverified] == [(8, "pass"), (4, "fail")]
    assert read_manifest(iter_dir(job.save, 4)).status == "invalid"


def _recovered(job: Job, approver) -> "Incident":  # noqa: F821
    from tasks.profile import load_profile
    from tasks.recovery.run import Source
    from tasks.recovery.run import recover as run_recovery

    return run_recovery(load_profile(job.profile), Source(logs=[job.log]), "test", approver)


def test_a_relaunch_script_that_changed_the_model_is_refused_before_any_node_is_touched(failed, tmp_path):
    job = job_copy(failed, tmp_path, extra=("--num-layers", "3", "--lr", "2e-3"))
    asked = []
    incident = _recovered(job, lambda plan: asked.append(plan))
    assert not asked and incident.outcome == "stopped" and incident.relaunched_job is None
    assert incident.reason == (
        "relaunch refused: the script does not fit checkpoint 8: architecture: --num-layers is 3, the "
        "checkpoint was saved with 2: the checkpoint's weights are not this model's (fix the script, then "
        "`ckptops recover --retry`)"
    )
    assert "health_done" not in incident.times  # no node drained, no spare taken for it
    summary, *lines = incident.relaunch_args
    assert summary.endswith("compared, 1 refuse, 1 warn")
    assert any(
        line.startswith("warn: optimizer: --lr is 0.002, the checkpoint was saved with 0.001")
        for line in lines
    )
    assert not processes_of(job.save)


def test_a_data_change_waits_for_a_person_even_where_its_class_is_auto_approved(failed, tmp_path):
    from tasks.recovery.report import plan_markdown
    from tasks.recovery.run import Decision

    every = ["hardware", "network", "numerics", "oom", "software", "hang", "preempted", "unknown"]
    job = job_copy(failed, tmp_path, extra=("--global-batch-size", "16"), auto_approve=every)
    asked = []
    incident = _recovered(job, lambda plan: asked.append(plan) or Decision(False, "an approver who says no"))
    (plan,) = asked
    form = plan_markdown(plan)
    assert (
        "**needs your approval**: data: --global-batch-size is 16, the checkpoint was saved with 8: the "
        "data order, or what a sample is, changes from here on"
    ) in form
    assert "not asked (recovery.job_python is not set)" in form
    assert incident.outcome == "aborted" and incident.relaunched_job is None


def test_a_checkpoint_that_nans_three_iterations_after_every_load_is_relaunched_at_most_twice(
    failed, tmp_path
):
    """Megatron-LM #5281's loop: every relaunch goes NaN three iterations after its load (the
    recovery's environment carries the fault into each relaunch). The first relaunch (the ECC
    failure's) loads 8 and NaNs; the next recovery falls back to 4, pinned, which NaNs too; the
    third is stopped by the rules, where #5281 restarted 44 times."""
    job = job_copy(failed, tmp_path)
    log, found = job.log, []
    for _ in range(4):
        out, err = recover(job, env={"CKPTOPS_FAIL_AT": "0:+3:nan"}, log=log).communicate(timeout=600)
        found.append(json.loads(out))
        new = found[-1]["relaunched_job"]
        if new is None:
            break
        until(lambda new=new: not process.running(local_pid(new)), 300, "the relaunch went NaN and ended")
        log = max((tmp_path / "logs").glob("relaunch-*.out"), key=lambda p: p.stat().st_mtime)
    said = [(i["outcome"], i["reason"]) for i in found]
    assert [i["checkpoint"] for i in found] == [8, 4, None], said
    assert [i["class"] for i in found] == ["hardware", "numerics", "numerics"], said
    fell = found[1]
    assert fell["fallback_from"] == 8
    assert fell["fallback"].startswith(
        f"numerics at iteration 10, 2 iterations after {found[0]['id']} resumed"
    )
    assert pins(job.save)[4] == [f"recovery-{fell['id']}"]
    last = found[2]
    assert last["outcome"] == "stopped" and last["relaunched_job"] is None
    assert last["stop_rule"] == "numerics-reproduced", last["reason"]
    assert f"numerics again after {fell['id']} fell back from checkpoint 8 to 4" in last["reason"]


def test_a_minimal_profile_drives_every_phase_of_a_recovery_and_a_rejection_stops_the_job(failed, tmp_path):
    """The smallest profile a team would write (what the job is and where its script and records
    are; every other setting its default) through every phase on the real job: triage, stop rules,
    the checkpoint verified again, nodes, a person's approval (the relaunch trains with another
    seed, which the approver accepts), the relaunch, its watch, the validation that rejects it (the
    batches are not the run's), the default on_rejected stopping it, and the ledger."""
    job = job_copy(failed, tmp_path, extra=("--seed", "999"))
    job.profile.write_text(
        yaml.safe_dump(
            {
                "job": {"name": "safe", "save_dir": str(job.save), "layout": {"data_parallel": 2}},
                "recovery": {
                    "launcher": "local",
                    "script": str(job.script),
                    "step_records": str(job.records),
                },
            }
        )
    )
    run = recover(job)
    out, err = run.communicate(timeout=600)
    incident = json.loads(out)
    new = incident["relaunched_job"]
    try:
        assert run.returncode == 1 and "Traceback" not in err, err[-3000:]
        assert incident["outcome"] == "stopped" and incident["checkpoint"] == 8
        assert incident["reason"].startswith(
            f"resume rejected, job {new} stopped: REJECTED resume from iteration 8: data order: "
        ), incident["reason"]
        phases = [
            "detected",
            "triaged",
            "reverified",
            "health_done",
            "approval_requested",
            "approved",
            "relaunch_submitted",
            "job_running",
            "first_resumed_step",
            "validated",
        ]
        assert [p for p in phases if p not in incident["times"]] == []
        assert len(incident["rules"]) == 7 and incident["stop_rule"] is None
        assert incident["health"] == "no health checks (no health section)"
        assert any("--seed is 999" in line for line in incident["relaunch_args"]), incident["relaunch_args"]
        # Megatron-LM printed the seed the approver approved: the relaunch went on.
        assert incident["approved_args"] == ["seed"]
        assert any(line.startswith("approve: data: seed (printed at ") for line in incident["printed_args"])
        assert incident["validation"].startswith("REJECTED") and incident["recomputed_iterations"] == 1
        assert [(i.id, i.outcome) for i in incidents(job.save)] == [(incident["id"], "stopped")]
        assert not process.running(local_pid(new)) and not processes_of(job.save)
    finally:
        stop_job(new)


def test_the_adopting_page_runs_as_written_on_a_job_whose_profile_names_no_step_records(failed, tmp_path):
    """docs/adopting.md, every ``sh`` block in order, as a new user runs them on the failed job
    (its save directory, batch script and log; a profile ckptops writes, naming no step records):
    a starting profile that checks, promotion, a drill, a recovery watched and validated from the
    relaunch's own output (nothing writes the failed run's log any more), goodput from
    Megatron-LM's save timers."""
    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "docs" / "adopting.md").read_text(), re.S)
    assert len(blocks) >= 6
    job = job_copy(failed, tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    names = {"SAVE": job.save, "SCRIPT": job.script, "LOG": job.log, "WORK": work}
    env = {**os.environ, **{k: str(v) for k, v in names.items()}}
    env["PATH"] = f"{CKPTOPS.parent}{os.pathsep}{os.environ['PATH']}"
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(blocks)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    incident = json.loads((work / "incident.json").read_text())
    new = incident["relaunched_job"]
    try:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert "step_records" not in (work / "mine.yaml").read_text().split("# step_records")[0]
        assert incident["outcome"] == "completed" and incident["checkpoint"] == 8, incident["reason"]
        assert incident["watched"] == incident["relaunch_log"]
        assert Path(incident["watched"]).parent == tmp_path / "ckptops-logs"  # profile init's log_dir
        assert incident["validation"].startswith("VALIDATED resume from iteration 8"), incident["validation"]
        assert incident["failure_iteration"] == 9  # from the failed run's log
        assert "PASS drill from shared, iteration 8" in done.stdout
        assert f"save timers in {job.log}" in done.stdout
    finally:
        stop_job(new)


def test_a_relaunch_whose_printed_arguments_change_the_model_is_stopped_before_it_trains(failed, tmp_path):
    """The script reads the model's size from a config file (``$(cat model.args)``), which the
    pre-check reading the script cannot see: it finds nothing to refuse. Megatron-LM's own
    arguments block in the relaunch's output says --num-layers 3 against the checkpoint's 2:
    the relaunch is stopped before its first iteration and the incident names the argument."""
    job = job_copy(failed, tmp_path)
    config = tmp_path / "model.args"
    config.write_text("--num-layers 3\n")
    text = job.script.read_text()
    assert text.count('"${fault[@]}"') == 1
    job.script.write_text(text.replace('"${fault[@]}"', f'"${{fault[@]}}" $(cat {config})'))
    run = recover(job)
    out, err = run.communicate(timeout=600)
    incident = json.loads(out)
    new = incident["relaunched_job"]
    try:
        assert run.returncode == 1 and new is not None, err[-3000:]
        assert not any(line.startswith("refuse:") for line in incident["relaunch_args"][1:])
        reason = incident["reason"]
        assert reason.startswith(
            f"relaunch {new} does not fit checkpoint 8 by the arguments Megatron-LM printed ("
        ), reason
        assert (
            "architecture: num_layers (printed at " in reason
            and "is 3, the checkpoint was saved with 2" in reason
        )
        assert reason.endswith("before its first iteration"), reason
        # Megatron-LM's own iteration lines ("... | consumed samples: ...") never began.
        assert "consumed samples:" not in Path(incident["relaunch_log"]).read_text()
        assert not process.running(local_pid(new)) and not processes_of(job.save)
        assert "first_resumed_step" not in incident["times"] and "validated" not in incident["times"]
    finally:
        stop_job(new)
