"""Recovery pieces that need no cluster: the stop rules over a ledger, the ledger itself, the
relaunch's safety checks and its sbatch line, and Slurm's answer for a job it does not know."""

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from tasks.errors import UsageError
from tasks.profile import Recovery
from tasks.recovery import job as jobs
from tasks.recovery.ledger import Incident, incidents, ledger_path, lost_gpu_hours, record
from tasks.recovery.rules import Failure, fired, stop_rules

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


def test_numerics_after_a_resume_oom_and_exit_17_stop():
    assert names(stop_rules(Failure("numerics", 300, 1, 100, NOW), [past("numerics", 250, 100)], 9)) == [
        "numerics-reproduced"
    ]
    assert names(stop_rules(Failure("numerics", 300, 1, 100, NOW), [], 9)) == []
    assert names(stop_rules(Failure("oom", 300, 1, 100, NOW), [], 9)) == ["out-of-memory"]
    assert names(stop_rules(Failure("numerics", 300, 17, 100, NOW), [], 9)) == ["result-validation-failed"]


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
    with pytest.raises(jobs.RelaunchRefused, match="lacks --exit-on-missing-checkpoint"):
        jobs.check_script(missing.script)
    local = settings(
        tmp_path,
        "#!/bin/bash\nsrun python pretrain_gpt.py --exit-on-missing-checkpoint "
        "--non-persistent-ckpt-type local\n",
    )
    with pytest.raises(jobs.RelaunchRefused, match="--non-persistent-ckpt-type"):
        jobs.check_script(local.script)
    with pytest.raises(UsageError, match=str(tmp_path / "absent")):
        jobs.check_script(tmp_path / "absent")


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
    write_lines(
        path,
        {"id": "bad-times", "job": "job", "trigger": "cli", "times": [1, 2]},
        {"id": "bad-nodes", "job": "job", "trigger": "cli", "suspect_nodes": "n1"},
        '{"id": "nan", "job": "job", "trigger": "cli", "times": {"detected": NaN}}',
        '["not", "an", "incident"]',
    )
    found = read_ledger(tmp_path)
    assert [i.id for i in found.incidents] == ["i0"]
    assert found.problems == [
        f"{path}:2: times: Input should be a valid dictionary; skipped",
        f"{path}:3: suspect_nodes: Input should be a valid list; skipped",
        f"{path}:4: not JSON (NaN is not a number JSON allows); skipped",
        f"{path}:5: not an incident (no id); skipped",
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


def local_profile(tmp_path: Path, **recovery) -> Path:
    save = tmp_path / "checkpoints"
    save.mkdir(exist_ok=True)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\npython pretrain_gpt.py --exit-on-missing-checkpoint\n")
    path = tmp_path / "profile.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "job": {"name": "job", "save_dir": str(save)},
                "recovery": {"launcher": "local", "script": str(script), "max_per_hour": 3, **recovery},
            }
        )
    )
    return path


def test_recover_counts_a_killed_recoverys_running_incident_and_skips_a_bad_line(tmp_path):
    """Three recoveries in the last hour, the newest left running by a recovery killed with
    SIGKILL, and a line of wrong types: the killed one is closed, the bad line reported and left
    out, and the hourly cap stops this recovery without a relaunch."""
    from tests.test_cli import ckptops_here

    profile = local_profile(tmp_path)
    save = tmp_path / "checkpoints"
    now = time.time()
    for n in range(3):
        incident = past("network", 100 + n, None, ago=600 * (n + 1), relaunched=False, n=n)
        incident.times["detected"] = now - 600 * (n + 1)
        incident.outcome = "running" if n == 0 else "stopped"
        incident.owner = {"host": "elsewhere", "pid": 1, "started": 0.0}
        record(save, incident)
    write_lines(ledger_path(save), {"id": "bad", "job": "job", "trigger": "cli", "times": [1]})
    done = ckptops_here("recover", "--logs", HARDWARE_LOG, "--json", "--profile", profile)
    assert done.exit_code == 1, done.stderr
    this = json.loads(done.stdout)
    assert this["stop_rule"] == "too-many-per-hour" and this["relaunched_job"] is None
    assert f"{ledger_path(save)}:4: times: Input should be a valid dictionary; skipped" in done.stderr
    killed = next(i for i in incidents(save) if i.id == "i0")
    assert killed.outcome == "interrupted" and "was killed; nothing was relaunched" in killed.reason
    listed = ckptops_here("incidents", "--profile", profile)
    assert listed.exit_code == 0 and "times: Input should be a valid dictionary" in listed.stderr
    measured = ckptops_here("goodput", "--profile", profile, "--json")
    assert measured.exit_code == 0 and json.loads(measured.stdout)["incidents"] == 4


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
