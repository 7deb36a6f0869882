"""Recovery pieces that need no cluster: the stop rules over a ledger, the ledger itself, the
relaunch's safety checks and its sbatch line, and Slurm's answer for a job it does not know."""

import json
from pathlib import Path

import pytest

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
