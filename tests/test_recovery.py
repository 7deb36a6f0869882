"""Recovery pieces that need no cluster: the stop rules over a ledger, the ledger itself, the
relaunch's safety checks and its sbatch line, and Slurm's answer for a job it does not know."""

import json
import os
from pathlib import Path

import pytest
import yaml

from tasks.errors import Unreadable, UsageError
from tasks.profile import Recovery
from tasks.recovery import job as jobs
from tasks.recovery.ledger import Incident, incidents, ledger_path, lost_gpu_hours, record
from tasks.recovery.rules import Failure, fired, soon_after_resume, stop_rules
from tasks.relaunch.precheck import RelaunchRefused, check_script

NOW = 1_800_000_000.0


def past(cls: str, iteration: int, promoted: int, ago: float = 7200, relaunched: bool = True, n: int = 0):
    return Incident(
        f"i{n}",
        "job",
        "event",
        times={"detected": NOW - ago},
        cls=cls,
        failure_iteration=iteration,
        promoted_at_failure=promoted,
        relaunched_job="42" if relaunched else None,
    )


def names(rules) -> list[str]:
    return [r.name for r in fired(rules)]


def test_a_first_failure_fires_no_rule_and_every_rule_is_named():
    rules = stop_rules(Failure("hardware", 120, 1, 100, NOW), [], max_per_hour=3)
    assert names(rules) == []
    assert [r.name for r in rules] == [
        "same-failure-again",
        "no-checkpoint-progress",
        "too-many-per-hour",
        "numerics-reproduced",
        "out-of-memory",
        "data-after-skip",
        "result-validation-failed",
    ]


def test_the_same_failure_at_the_same_iteration_is_retried_once_then_stopped():
    history = [past("network", 120, 100)]
    assert names(stop_rules(Failure("network", 120, 1, 100, NOW), history, 3)) == ["same-failure-again"]
    # Another class, or another place, is a new failure.
    assert names(stop_rules(Failure("hardware", 120, 1, 100, NOW), history, 3)) == []
    assert names(stop_rules(Failure("network", 150, 1, 100, NOW), history, 3)) == []


def test_a_newer_promoted_checkpoint_resets_the_recurrence_budget():
    history = [past("network", 120, 100), past("hardware", 130, 100), past("software", 140, 100)]
    assert set(names(stop_rules(Failure("network", 120, 1, 100, NOW), history, 9))) == {
        "same-failure-again",
        "no-checkpoint-progress",
    }
    assert names(stop_rules(Failure("network", 120, 1, 200, NOW), history, 9)) == []


def test_a_rolled_back_pointer_is_no_progress_until_a_checkpoint_past_the_resume_is_promoted():
    history = []
    for n, c in enumerate(("hardware", "network", "hang")):
        incident = past(c, 5000 + n, 5000, n=n)
        incident.checkpoint = 4000  # each relaunched from 4000, the pointer rolled back to it
        history.append(incident)
    assert names(stop_rules(Failure("software", 4001, 1, 4000, NOW), history, 9)) == [
        "no-checkpoint-progress"
    ]
    # 4800 promoted since: the job trained past where it resumed.
    assert names(stop_rules(Failure("software", 4801, 1, 4800, NOW), history, 9)) == []


def test_no_checkpoint_progress_across_three_recoveries_stops():
    history = [past(c, 100 + n, 100, n=n) for n, c in enumerate(("hardware", "network", "hang"))]
    assert names(stop_rules(Failure("software", 190, 1, 100, NOW), history, 9)) == ["no-checkpoint-progress"]
    # Recoveries that never relaunched made no attempt: they do not count.
    idle = [past("hardware", 100 + n, 100, relaunched=False, n=n) for n in range(3)]
    assert names(stop_rules(Failure("software", 190, 1, 100, NOW), idle, 9)) == []


def test_more_than_max_per_hour_stops_whatever_was_promoted():
    history = [past("hardware", 100 + n, 100 + n, ago=600 * (n + 1), n=n) for n in range(3)]
    assert names(stop_rules(Failure("network", 500, 1, 400, NOW), history, 3)) == ["too-many-per-hour"]
    assert names(stop_rules(Failure("network", 500, 1, 400, NOW), history, 4)) == []
    old = [past("hardware", 100 + n, 100 + n, ago=3700, n=n) for n in range(3)]
    assert names(stop_rules(Failure("network", 500, 1, 400, NOW), old, 3)) == []


def test_a_failure_the_infrastructure_caused_counts_against_no_budget():
    """Preemptions relaunched in the last hour leave the hourly cap and the recurrence rules to the
    job's own failures, and a preemption itself fires none of them."""
    preempted = [past("preempted", 120, 100, ago=600 * (n + 1), n=n) for n in range(3)]
    for incident in preempted:
        incident.infrastructure = "*** JOB 1 ON n1 CANCELLED AT 2026-12-06T10:00:00 DUE TO PREEMPTION ***"
    assert names(stop_rules(Failure("hardware", 120, 1, 100, NOW), preempted, 3)) == []
    counted = [past("preempted", 120, 100, ago=600 * (n + 1), n=n) for n in range(3)]
    assert "too-many-per-hour" in names(stop_rules(Failure("hardware", 120, 1, 100, NOW), counted, 3))
    real = [past("hardware", 120, 100, ago=600 * (n + 1), n=n) for n in range(3)]
    taken = Failure("preempted", 120, 1, 100, NOW, infrastructure="DUE TO PREEMPTION")
    rules = stop_rules(taken, real, 3)
    assert names(rules) == [] and len(rules) == 7
    assert rules[2].detail == "the infrastructure took the nodes away (DUE TO PREEMPTION): not counted"
    # A NaN three iterations after the checkpoint a preemption's relaunch loaded: that load is
    # still the one suspected, though the preemption counts against no budget.
    loaded = past("preempted", 120, 100, ago=600, n=9)
    loaded.infrastructure, loaded.checkpoint = "DUE TO PREEMPTION", 100
    assert soon_after_resume(Failure("numerics", 103, 1, 100, NOW), real[:1] + [loaded], 50) is loaded


def test_numerics_after_a_resume_oom_and_exit_17_stop():
    assert names(stop_rules(Failure("numerics", 300, 1, 100, NOW), [past("numerics", 250, 100)], 9)) == [
        "numerics-reproduced"
    ]
    assert names(stop_rules(Failure("numerics", 300, 1, 100, NOW), [], 9)) == []
    assert names(stop_rules(Failure("oom", 300, 1, 100, NOW), [], 9)) == ["out-of-memory"]
    assert names(stop_rules(Failure("numerics", 300, 17, 100, NOW), [], 9)) == ["result-validation-failed"]
    # Exit 17 with the rerun state machine's verdict (the data, or that GPU): a cause, not a stop.
    assert names(stop_rules(Failure("data", 300, 17, 100, NOW, position=301), [], 9)) == []
    assert names(stop_rules(Failure("hardware", 300, 17, 100, NOW), [], 9)) == []


def test_a_data_failure_is_relaunched_past_its_window_once_and_a_second_one_there_stops():
    """Megatron's rerun state machine reproduced a NaN at iteration 6 on another GPU (data);
    the relaunch from 4 skipped iteration 6. The same position failing again, as data or as a
    NaN, stops; a data failure elsewhere is relaunched past too, and the same cause at the same
    position is tried at most twice."""
    skipped = past("data", 5, 5, n=1)
    skipped.skipped = {"iterations": [6], "samples": [40, 48], "tokens": 256, "confirmed": True}
    for cls in ("data", "numerics"):
        again = stop_rules(Failure(cls, 5, 17, 5, NOW, position=6), [skipped], 9)
        assert "data-after-skip" in names(again)
        rule = next(r for r in again if r.name == "data-after-skip")
        assert "again after i1 relaunched past iterations [6]" in rule.detail
    assert names(stop_rules(Failure("data", 11, 17, 5, NOW, position=12), [skipped], 9)) == []
    # Relaunched but stopped before Megatron-LM was told to skip: it skipped nothing.
    skipped.skipped["confirmed"] = False
    assert names(stop_rules(Failure("numerics", 5, 16, 5, NOW, position=6), [skipped], 9)) == []
    # Not relaunched (a person said no): it skipped nothing.
    skipped.skipped["confirmed"], skipped.relaunched_job = True, None
    assert names(stop_rules(Failure("data", 5, 17, 5, NOW, position=6), [skipped], 9)) == []
    tried = [past("data", 12, 5, n=2)]
    assert names(stop_rules(Failure("data", 12, 17, 5, NOW, position=13), tried, 9)) == ["same-failure-again"]


def test_numerics_soon_after_a_resume_falls_back_once_before_it_stops():
    resumed = past("hardware", 120, 100)
    resumed.checkpoint = 100
    # Three iterations after the relaunch loaded 100: 100 is suspect, no rule stops yet.
    failure = Failure("numerics", 103, 1, 100, NOW)
    assert names(stop_rules(failure, [resumed], 9, fallback_within=50)) == []
    assert soon_after_resume(failure, [resumed], 50) is resumed
    # Far from the load, or not numerical: not the checkpoint's doing.
    assert soon_after_resume(Failure("numerics", 190, 1, 100, NOW), [resumed], 50) is None
    assert soon_after_resume(Failure("hardware", 103, 1, 100, NOW), [resumed], 50) is None
    # Numerics soon after a resume that itself followed numerics: still one fall back first.
    earlier = past("numerics", 110, 100, n=1)
    earlier.checkpoint = 100
    assert names(stop_rules(failure, [earlier], 9, fallback_within=50)) == []
    # After a fall back, numerics again is not the checkpoint: stop.
    fell = past("numerics", 103, 100, n=2)
    fell.checkpoint, fell.fallback_from = 96, 100
    again = stop_rules(Failure("numerics", 99, 1, 100, NOW), [earlier, fell], 9, fallback_within=50)
    assert names(again) == ["numerics-reproduced"]
    assert "fell back from checkpoint 100 to 96" in fired(again)[0].detail


def test_a_job_that_nans_three_iterations_after_every_load_is_relaunched_at_most_twice():
    """Megatron-LM #5281's loop (NaN three iterations after each load, 44 restarts by hand) run
    through the stop rules and the fall-back choice: the job saves every 4 iterations and has
    checkpoints up to 100 when it first fails, at 103, after a relaunch from 100."""
    checkpoints = list(range(4, 101, 4))
    history: list[Incident] = []
    relaunches, loaded, failing_at = 0, 100, 103
    for n in range(44):
        failure = Failure("numerics", failing_at, 1, 100, NOW + n, key=f"f{n}")
        if fired(stop_rules(failure, history, 99, fallback_within=50)):
            break
        resumed = soon_after_resume(failure, history, 50)
        before = resumed.checkpoint if resumed else failing_at  # else: before the anomaly
        chosen = max(c for c in checkpoints if c < before)
        incident = past("numerics", failing_at, 100, ago=-n, n=n)
        incident.failure_key, incident.checkpoint = f"f{n}", chosen
        incident.fallback_from = resumed.checkpoint if resumed else None
        history.append(incident)
        relaunches += 1
        loaded, failing_at = chosen, chosen + 3
    assert relaunches <= 2, [(i.checkpoint, i.fallback_from) for i in history]
    assert [i.checkpoint for i in history] == [100, 96] and history[-1].fallback_from == 100
    assert loaded == 96


def test_the_ledger_appends_one_line_per_incident_and_survives_a_torn_line(tmp_path):
    first = past("hardware", 120, 100)
    record(tmp_path, first)
    with open(ledger_path(tmp_path), "a") as f:
        f.write('{"id": "torn", "jo')  # a crash mid-append
    second = past("network", 130, 100, n=1)
    second.mark("validated", NOW)
    record(tmp_path, second)
    found = incidents(tmp_path)
    assert [i.id for i in found] == ["i0", "i1"] and found[1].times["validated"] == NOW
    line = json.loads(ledger_path(tmp_path).read_text().splitlines()[-1])
    assert line["class"] == "network" and "cls" not in line


def test_lost_gpu_hours_count_downtime_and_recomputed_steps():
    # 5,120 GPUs down 10 minutes, then 30 iterations of 6 s redone: 853.3 + 256 GPU-hours.
    assert lost_gpu_hours(5120, 600, 30, 6.0) == pytest.approx(5120 * (600 + 180) / 3600)
    assert lost_gpu_hours(8, -5, -1, 1.0) == 0.0


def settings(tmp_path: Path, text: str, **extra) -> Recovery:
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    return Recovery(script=script, **extra)


def test_a_relaunch_that_could_start_from_random_weights_or_a_non_persistent_checkpoint_is_refused(tmp_path):
    missing = settings(tmp_path, "#!/bin/bash\nsrun python pretrain_gpt.py --load /ckpt --save /ckpt\n")
    with pytest.raises(RelaunchRefused, match="lacks --exit-on-missing-checkpoint"):
        check_script(missing.script)
    local = settings(
        tmp_path,
        "#!/bin/bash\nsrun python pretrain_gpt.py --exit-on-missing-checkpoint "
        "--non-persistent-ckpt-type local\n",
    )
    with pytest.raises(RelaunchRefused, match="--non-persistent-ckpt-type"):
        check_script(local.script)
    with pytest.raises(Unreadable, match=str(tmp_path / "absent")):
        check_script(tmp_path / "absent")


def test_the_sbatch_line_excludes_passes_the_step_both_ways_and_waits_for_the_singleton(tmp_path):
    ok = settings(tmp_path, "#!/bin/bash\nsrun python pretrain_gpt.py --exit-on-missing-checkpoint\n")
    argv = jobs.sbatch_command(ok, "gpt-500b", 12000, ["gpu7", "gpu3"], tmp_path)
    assert argv[:4] == ["sbatch", "--parsable", "--job-name=gpt-500b", "--dependency=singleton"]
    assert "--export=ALL,CKPT_STEP=12000" in argv and "--exclude=gpu3,gpu7" in argv
    assert argv[-3:] == [str(ok.script), "--ckpt-step", "12000"]
    env_only = Recovery(script=ok.script, pass_step=["env"])
    assert jobs.sbatch_command(env_only, "j", 5, [], tmp_path)[-1] == str(ok.script)


def test_a_slurm_job_that_does_not_exist_is_one_line(slurm_conf):
    with pytest.raises(UsageError, match=r"^Slurm job 999999: no such job"):
        jobs.slurm_job("999999")
    with pytest.raises(UsageError, match="not a job id"):
        jobs.slurm_job("12; rm -rf /")


def test_the_block_layout_maps_ranks_to_nodes():
    job = jobs.SlurmJob("1", "j", "FAILED", ["n1", "n2"], 4, None, None, 1, "")
    assert job.layout() == {0: "n1", 1: "n1", 2: "n2", 3: "n2"}


# The ledger's readers never break on a bad line.

HARDWARE_LOG = (
    Path(__file__).parent
    / "data"
    / "triage"
    / "hardware"
    / "ecc_uncorrectable_nccl_watchdog_rank1_2xh100_sdscripts_issue1434.log"
)


def write_lines(path: Path, *entries) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for entry in entries:
            f.write((entry if isinstance(entry, str) else json.dumps(entry)) + "\n")


def test_a_wrongly_typed_ledger_line_is_reported_once_by_line_and_field_and_skipped(tmp_path):
    from tasks.recovery.ledger import read_ledger

    good = past("hardware", 120, 100)
    record(tmp_path, good)
    path = ledger_path(tmp_path)
    line = {"job": "job", "trigger": "cli"}
    write_lines(
        path,
        {"id": "bad-times", **line, "times": [1, 2]},
        {"id": "bad-nodes", **line, "suspect_nodes": "n1"},
        '{"id": "nan", "job": "job", "trigger": "cli", "times": {"detected": NaN}}',
        '["not", "an", "incident"]',
        {"id": "text-number", **line, "times": {"detected": "NaN"}},
        '{"id": "huge", "job": "job", "trigger": "cli", "times": {"detected": 1e999}}',
        {"id": "exit-as-text", **line, "exit_code": "7"},
        {"id": "gpus-as-bool", **line, "gpus": True},
        {"id": "error-text", **line, "first_error": {"file": "x", "line": 1, "text": ["a"]}},
    )
    found = read_ledger(tmp_path)
    assert [i.id for i in found.incidents] == ["i0"]
    assert found.problems == [
        f"{path}:2: times: Input should be an object; skipped",
        f"{path}:3: suspect_nodes: Input should be a valid array; skipped",
        f"{path}:4: not JSON (NaN is not a number JSON allows); skipped",
        f"{path}:5: not an incident (no id); skipped",
        f"{path}:6: times.detected: Input should be a valid number; skipped",
        f"{path}:7: times.detected: Input should be a finite number; skipped",
        f"{path}:8: exit_code: Input should be a valid integer; skipped",
        f"{path}:9: gpus: Input should be a valid integer; skipped",
        f"{path}:10: first_error.text: Input should be a valid string; skipped",
    ]


def test_the_newest_line_of_an_incident_is_the_incident_in_the_place_it_began(tmp_path):
    first, second = past("hardware", 120, 100, n=0), past("network", 130, 100, n=1)
    first.outcome = second.outcome = "running"
    record(tmp_path, first)
    record(tmp_path, second)
    first.outcome, first.reason = "completed", "resumed"
    record(tmp_path, first)
    assert [(i.id, i.outcome) for i in incidents(tmp_path)] == [("i0", "completed"), ("i1", "running")]


def test_a_first_error_of_200_mb_is_kept_to_a_few_kb_with_its_length(tmp_path):
    incident = past("oom", 120, 100)
    incident.first_error = {"file": "x.log", "line": 1, "text": "torch.OutOfMemoryError: " + "x" * 10_000_000}
    incident.reason = "r" * 1_000_000
    record(tmp_path, incident)
    line = ledger_path(tmp_path).read_text()
    assert len(line) < 10_000
    (back,) = incidents(tmp_path)
    assert back.first_error["text"].startswith("torch.OutOfMemoryError: xxx")
    assert back.first_error["text"].endswith("[... 10000024 characters in all]")
    assert back.reason.endswith("[... 1000000 characters in all]")


def test_no_figure_in_a_ledger_line_is_nan(tmp_path):
    incident = past("hardware", 120, 100)
    incident.mark("first_resumed_step", float("nan"))
    incident.lost_gpu_hours = float("nan")
    record(tmp_path, incident)
    line = json.loads(ledger_path(tmp_path).read_text(), parse_constant=lambda c: pytest.fail(c))
    assert "first_resumed_step" not in line["times"] and line["lost_gpu_hours"] is None


def local_profile(tmp_path: Path, save: Path | None = None, **recovery) -> Path:
    save = save or tmp_path / "checkpoints"
    save.mkdir(exist_ok=True)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\npython pretrain_gpt.py --exit-on-missing-checkpoint\n")
    path = tmp_path / "profile.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "job": {"name": "job", "save_dir": str(save), "layout": {"data_parallel": 2}},
                "recovery": {"launcher": "local", "script": str(script), "max_per_hour": 3, **recovery},
            }
        )
    )
    return path


def test_recover_counts_a_killed_recoverys_relaunch_and_skips_a_bad_line(tmp_path):
    """Three relaunches in the last hour, the newest by a recovery killed with SIGKILL (its
    incident left running, its relaunch since dead), a recovery that relaunched nothing, and a
    line of wrong types: the killed one is closed, the bad line reported and left out, and the
    hourly cap counts the three relaunches and stops this recovery without a relaunch."""
    from tests.conftest import exited_process_identity
    from tests.test_cli import ckptops_here

    profile = local_profile(tmp_path)
    save = tmp_path / "checkpoints"
    dead = exited_process_identity()
    for n in range(4):
        incident = past("network", 100 + n, 100 + n, ago=600 * (n + 1), relaunched=n < 3, n=n)
        incident.outcome = "running" if n == 0 else "stopped"
        incident.owner = {"host": dead["host"], "pid": 1, "started": 0.0}
        if n == 0:
            incident.relaunched_job, incident.relaunch_process = f"local:{dead['pid']}", dead
        record(save, incident)
    write_lines(ledger_path(save), {"id": "bad", "job": "job", "trigger": "cli", "times": [1]})
    done = ckptops_here("recover", "--logs", HARDWARE_LOG, "--json", "--profile", profile)
    assert done.exit_code == 1, done.stderr
    this = json.loads(done.stdout)
    assert this["stop_rule"] == "too-many-per-hour" and this["relaunched_job"] is None
    assert "3 relaunches in the last hour" in this["reason"]
    assert f"{ledger_path(save)}:5: times: Input should be an object; skipped" in done.stderr
    killed = next(i for i in incidents(save) if i.id == "i0")
    assert killed.outcome == "interrupted"
    assert killed.reason.endswith(f"was killed; its relaunched job local:{dead['pid']} is no longer running")
    listed = ckptops_here("incidents", "--profile", profile)
    assert listed.exit_code == 0 and "times: Input should be an object" in listed.stderr
    measured = ckptops_here("goodput", "--profile", profile, "--json")
    assert measured.exit_code == 0 and json.loads(measured.stdout)["incidents"] == 5


def test_an_aborted_recovery_stands_until_retry_and_a_retry_is_no_recurrence(save_dir, tmp_path):
    """The approver said no: the same failure recovered again is refused (exit 3) unless asked
    with --retry, and the retry is not stopped by same-failure-again (the aborted one relaunched
    nothing and is this very failure)."""
    from tests.test_cli import ckptops_here

    profile = local_profile(tmp_path, save_dir)
    first = ckptops_here("recover", "--logs", HARDWARE_LOG, "--json", "--profile", profile)
    assert first.exit_code == 1 and json.loads(first.stdout)["outcome"] == "aborted"
    # Nobody could be asked: the plan is shown, with the exact flags that approve it.
    assert "relaunch" in first.stderr.lower()
    assert "run the same command with --retry --approve" in first.stderr
    again = ckptops_here("recover", "--logs", HARDWARE_LOG, "--json", "--profile", profile)
    assert again.exit_code == 3 and "already handled this failure" in again.stderr
    assert "aborted, recover it again with --retry (the CLI) or retry: true (the flow)" in again.stderr
    retried = ckptops_here("recover", "--logs", HARDWARE_LOG, "--json", "--retry", "--profile", profile)
    incident = json.loads(retried.stdout)
    assert incident["outcome"] == "aborted" and incident["stop_rule"] is None
    assert [i.outcome for i in incidents(save_dir)] == ["aborted", "aborted"]


def test_step_records_that_do_not_exist_stop_the_recovery_before_any_relaunch(tmp_path):
    from tests.test_cli import ckptops_here

    absent = tmp_path / "nowhere" / "records.jsonl"
    profile = local_profile(tmp_path, step_records=str(absent), auto_approve=["hardware"])
    done = ckptops_here("recover", "--logs", HARDWARE_LOG, "--json", "--profile", profile)
    assert done.exit_code == 1
    incident = json.loads(done.stdout)
    assert incident["relaunched_job"] is None and incident["outcome"] == "stopped"
    assert incident["reason"].startswith(f"recovery.step_records: {absent}: No such file or directory")


def test_fifos_are_refused_by_every_reader_of_logs_in_one_line(tmp_path):
    """A FIFO with no writer used to block triage, recover and goodput --log until killed; each
    runs here as a process with a deadline, so a reader that blocks fails the test."""
    from tests.test_cli import ckptops

    fifo = tmp_path / "train.log"
    os.mkfifo(fifo)
    profile = local_profile(tmp_path, step_records=str(tmp_path / "records.fifo"))
    os.mkfifo(tmp_path / "records.fifo")
    triaged = ckptops("triage", fifo)
    assert triaged.returncode == 2 and triaged.stderr.strip() == (
        f"ckptops: {fifo}: a FIFO, not a regular file; give the file itself"
    )
    recovered = ckptops("recover", "--logs", fifo, "--json", "--profile", profile)
    assert (
        recovered.returncode == 1 and "a FIFO, not a regular file" in json.loads(recovered.stdout)["reason"]
    )
    for log in (fifo, HARDWARE_LOG):  # the records are a FIFO too
        measured = ckptops("goodput", "--log", log, "--profile", profile)
        assert measured.returncode == 2 and "a FIFO, not a regular file" in measured.stderr


def test_a_fifo_as_the_jobs_script_is_refused_in_one_line_before_anything_reads_it(save_dir, tmp_path):
    """A FIFO with no writer as recovery.script used to block the recovery for good at its
    comparison of the script (and bash, had it got so far): refused where it is first opened."""
    from tests.test_cli import ckptops

    fifo = tmp_path / "job.fifo"
    os.mkfifo(fifo)
    profile = local_profile(tmp_path, save_dir, script=str(fifo), auto_approve=["hardware"])
    done = ckptops("recover", "--logs", HARDWARE_LOG, "--json", "--profile", profile)  # a deadline
    incident = json.loads(done.stdout)
    assert done.returncode == 1 and incident["relaunched_job"] is None, done.stderr[-2000:]
    assert incident["reason"] == f"{fifo}: a FIFO, not a regular file; give the file itself"
    with pytest.raises(UsageError, match=f"^{fifo}: a FIFO, not a regular file; give the file itself$"):
        check_script(fifo)


def test_only_relaunches_count_and_a_retry_of_the_same_failure_is_no_recurrence():
    running = past("hardware", 120, 100, ago=60, n=0)
    running.outcome, running.failure_key = "running", "slurm:7:0:t0"
    aborted = past("hardware", 120, 100, ago=120, relaunched=False, n=1)
    # A running incident that has relaunched is a relaunch in the hour.
    assert names(stop_rules(Failure("hardware", 200, 1, 100, NOW, "slurm:8:0:t1"), [running], 1)) == [
        "too-many-per-hour"
    ]
    # An incident that relaunched nothing is no recurrence and no relaunch.
    assert names(stop_rules(Failure("hardware", 120, 1, 100, NOW, "slurm:9:0:t2"), [aborted], 1)) == []
    # The same failure's own incident is a retry, not the failure coming back.
    assert names(stop_rules(Failure("hardware", 120, 1, 100, NOW, "slurm:7:0:t0"), [running], 1)) == []
    assert names(stop_rules(Failure("hardware", 120, 1, 100, NOW, "slurm:9:0:t2"), [running], 3)) == [
        "same-failure-again"
    ]


def test_the_exact_ettr_of_a_hopeless_interval_is_zero_not_an_overflow():
    from tasks.goodput.advice import ettr_exact

    assert ettr_exact(save=60, mtbf=36, restart=300, interval=28800) == 0.0


def test_manifest_reverification_sees_a_resave_but_not_a_silent_flip(save_dir, options):
    """recovery.reverify: manifest compares the files' sizes and times with the manifest: a
    touched file is caught, a flipped bit with the times kept is not (only full reads it)."""
    from tasks.checkpoint.promote import promote, reverify
    from tests.conftest import flip_byte, iter_dir

    promote(save_dir, options, 30)
    flip_byte(iter_dir(save_dir, 24) / "__0_0.distcp", 5000)
    quick, _ = reverify(save_dir, options, 24, 30, full=False)
    assert quick.ok
    full, report = reverify(save_dir, options, 24, 30, full=True)
    assert not full.ok and "[crc]" in full.reason and report.current == 20
    os.utime(iter_dir(save_dir, 20) / "metadata.json")
    touched, report = reverify(save_dir, options, 20, 30, full=False)
    assert not touched.ok and report.current == 16


def test_the_terminal_prompt_waits_for_the_approval_timeout_only_and_then_says_no(save_dir, tmp_path):
    """An operator who walks away from the prompt must not hold the job's recovery lock for
    good: on a real terminal (a pty), no answer within recovery.approval_timeout_seconds is a no."""
    import pty
    import subprocess

    from tests.test_cli import CKPTOPS

    profile = local_profile(tmp_path, save_dir, approval_timeout_seconds=3)
    main, terminal = pty.openpty()
    done = subprocess.run(
        [str(CKPTOPS), "recover", "--logs", str(HARDWARE_LOG), "--json", "--profile", str(profile)],
        stdin=terminal,
        capture_output=True,
        text=True,
        timeout=300,
    )
    os.close(terminal)
    os.close(main)
    incident = json.loads(done.stdout)
    assert "relaunch from checkpoint 24?" in done.stderr
    assert done.returncode == 1 and incident["outcome"] == "aborted"
    assert incident["reason"] == "not approved (no answer on the terminal within 3s)"


def test_a_stop_for_no_usable_checkpoint_lists_each_checkpoint_and_its_failure(save_dir, tmp_path):
    """Every checkpoint fails verification (one flipped bit each): the recovery relaunches
    nothing, and its reason names each checkpoint with its own one-line failure."""
    from tests.conftest import ITERATIONS, flip_byte, iter_dir
    from tests.test_cli import ckptops_here

    for iteration in ITERATIONS:
        flip_byte(iter_dir(save_dir, iteration) / "__0_0.distcp", 100)
    profile = local_profile(tmp_path, save_dir, auto_approve=["hardware"])
    done = ckptops_here("recover", "--logs", HARDWARE_LOG, "--json", "--profile", profile)
    assert done.exit_code == 1, done.stderr
    incident = json.loads(done.stdout)
    assert incident["relaunched_job"] is None and incident["outcome"] == "stopped"
    reason = incident["reason"]
    assert reason.startswith("no usable checkpoint to resume from: iter_0000024 invalid: ")
    parts = reason.split(": ", 1)[1].split("; ")
    assert [p.split()[0] for p in parts] == [f"iter_{i:07d}" for i in reversed(ITERATIONS)]
    assert all(" invalid: " in p and "__0_0.distcp" in p for p in parts), reason


def test_a_job_slurm_preempted_was_taken_by_the_infrastructure_before_anything_else_is_asked(tmp_path):
    """JobState=PREEMPTED says it alone: no reservation or drain log is read."""
    from tasks.recovery.infrastructure import taken_away
    from tasks.recovery.job import SlurmJob

    job = SlurmJob(
        "7", "train", "PREEMPTED", ["n1"], 8, None, None, 0, "None", end_time="2026-12-06T10:00:00"
    )
    assert taken_away(job, tmp_path / "absent.jsonl") == "Slurm job 7: JobState=PREEMPTED (Reason=None)"


def test_a_drain_line_another_account_could_write_makes_no_cancellation_a_planned_swap(tmp_path, monkeypatch):
    """A job cancelled while the drain log says ckptops drained its node was taken away by a
    planned swap: but only a drain log ckptops's own account wrote says so (issue 56: a line
    appended to a world-writable health.raw_dir would blame the infrastructure for the job's own
    failure)."""
    from tasks.cluster import slurm
    from tasks.recovery.infrastructure import taken_away
    from tasks.recovery.job import SlurmJob
    from tasks.storage.local import append_private_jsonl

    monkeypatch.setattr(slurm, "reservations", lambda: [])
    job = SlurmJob(
        "7", "train", "CANCELLED", ["n1"], 8, None, None, 0, "None",
        start_time="2026-12-06T10:00:00", end_time="2026-12-06T11:00:00",
    )  # fmt: skip
    raw = tmp_path / "raw"
    raw.mkdir(mode=0o755)
    drains = raw / "drains.jsonl"
    at = slurm.slurm_time("2026-12-06T10:30:00")
    append_private_jsonl(drains, {"node": "n1", "at": at, "reason": "ckptops FAIL_HARDWARE xid"})
    assert taken_away(job, drains).startswith("Slurm job 7 cancelled after ckptops drained n1 during its run")
    raw.chmod(0o777)  # another account could have appended the line
    assert taken_away(job, drains) is None


@pytest.mark.parametrize("then", ["exec sleep 300", "exit 0"], ids=["running", "script-ended"])
def test_cancelling_a_local_relaunch_ends_a_child_that_left_its_session(tmp_path, then):
    """A relaunch's ``setsid -f`` child left its process group: cancel found only the group and
    left it training (issue 56). It is found by the launch's token in its environment, whether
    the script still runs or has already ended."""
    from types import SimpleNamespace

    from tasks.cluster import process
    from tasks.recovery.job import cancel, start_local
    from tests.helpers.poll import line_from_fifo

    fifo = tmp_path / "escaped.pid"
    os.mkfifo(fifo)
    script = tmp_path / "train.sh"
    script.write_text(
        "#!/bin/bash\n# --exit-on-missing-checkpoint\n"
        f"setsid -f bash -c 'echo $$ > {fifo}; exec sleep 300'\n{then}\n"
    )
    settings = SimpleNamespace(script=script, pass_step=("env",))
    job, holder, _ = start_local(settings, "train", 8, tmp_path / "logs", "t0k3n")
    escaped = int(line_from_fifo(fifo, 60, "the escaping child ran"))
    assert process.running(escaped)
    said = cancel(job, holder, timeout_seconds=20, hard=True)
    assert said.startswith(f"job {job} ")
    assert not process.running(escaped)


def test_the_failed_jobs_start_is_slurms_else_the_logs_first_time_less_any_zone():
    """What Flight Recorder dumps are compared with (tasks.recovery.run.job_started): Slurm's
    StartTime (scontrol's local time), else the logs' first time less 14 hours (a log's own zone
    read as UTC), else nothing known."""
    from datetime import datetime

    from tasks.recovery.run import job_started

    slurm = datetime(2026, 3, 1, 12, 0, 5).timestamp()
    assert job_started("0:2026-03-01T12:00:05", 1e9) == slurm
    assert job_started("2:2026-03-01T12:00:05", None) == slurm
    assert job_started("0:Unknown", 1_800_000_000.0) == 1_800_000_000.0 - 14 * 3600
    assert job_started(None, 1_800_000_000.0) == 1_800_000_000.0 - 14 * 3600
    assert job_started("0:None", None) is None and job_started(None, None) is None


def test_triage_says_when_the_logs_began(tmp_path):
    from tasks.recovery.triage import triage

    log = tmp_path / "job.log"
    log.write_text("no time here\n[2026-03-01 12:00:05] step 1\n[2026-03-01 12:09:00] step 2\n")
    bare = tmp_path / "bare.log"
    bare.write_text("no time at all\n")
    assert triage([bare, log]).logs_began == datetime_utc(2026, 3, 1, 12, 0, 5)
    assert triage([bare]).logs_began is None


def datetime_utc(*when) -> float:
    from datetime import UTC, datetime

    return datetime(*when, tzinfo=UTC).timestamp()


def test_a_recovery_refused_at_a_lock_file_of_another_account_writes_its_incident(tmp_path):
    """A recovery lock file another account owns is refused at once (whoever can open it can
    flock it): the recovery stops there, and its incident says so, naming the file."""
    from tasks.checkpoint.layout import RECOVERY_LOCK
    from tests.test_cli import ckptops_here

    profile = local_profile(tmp_path)
    save = tmp_path / "checkpoints"
    lock = save / RECOVERY_LOCK
    lock.write_text("")
    os.chmod(lock, 0o600)
    os.chown(lock, 65534, 65534)
    done = ckptops_here("recover", "--logs", HARDWARE_LOG, "--json", "--profile", profile)
    assert done.exit_code == 1, done.output
    incident = json.loads(done.stdout)
    assert incident["outcome"] == "stopped" and incident["relaunched_job"] is None
    assert (
        incident["reason"].startswith("the recovery lock of job is refused: ")
        and str(lock) in incident["reason"]
    )
    (written,) = incidents(save)
    assert written.reason == incident["reason"] and "Traceback" not in done.output
