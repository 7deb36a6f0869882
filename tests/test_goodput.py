"""Goodput: the interval advice and the simulator against their closed forms, the ledger's
measurements (surviving lineage, save times by source, incident losses, "not measured"), the
CLI's bad input, and the goodput-report flow's advice and interval warning."""

import json
import math
import shutil

import numpy as np
import pytest
import yaml

from tasks.errors import UsageError
from tasks.goodput.advice import advise, daly, ettr, ettr_exact, young
from tasks.goodput.measure import measure, save_times_from_records
from tasks.goodput.report import ledger_lines
from tasks.goodput.simulate import restart_for, save_cost_for, simulate
from tasks.job.save_log import read_save_log
from tasks.job.step_records import Steps
from tasks.recovery.ledger import Incident, record
from tests.test_cli import ckptops, ckptops_here

SEED = dict(save=180.0, mtbf=24 * 3600.0)


def test_the_seed_runs_numbers_young_92_95_and_daly_90_96_minutes():
    assert round(young(**SEED) / 60, 2) == 92.95
    interval, note = daly(**SEED)
    assert round(interval / 60, 2) == 90.96 and note is None
    found = advise(180, 86400, 600, 3600, 5120)
    assert found.ettr_advised > found.ettr_now  # hourly saves cost more than Daly's interval
    assert found.gpu_hours_per_day == pytest.approx(5120 * 24 * (found.ettr_advised - found.ettr_now))
    data = json.loads(
        ckptops(
            "goodput", "advise", "--save-seconds", 180, "--mtbf-hours", 24, "--restart-minutes", 10,
            "--interval-minutes", 60, "--gpus", 5120, "--json",
        ).stdout
    )  # fmt: skip
    assert {"young_minutes", "daly_minutes", "ettr_now", "ettr_advised"} <= set(data)
    assert round(data["young_minutes"], 2) == 92.95 and round(data["daly_minutes"], 2) == 90.96


def test_daly_does_not_apply_when_the_save_costs_two_mtbfs():
    interval, note = daly(save=7200, mtbf=3600)
    assert interval == 3600 and "does not apply" in note


@pytest.mark.parametrize("flag", ["--save-seconds", "--mtbf-hours", "--interval-minutes"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_zero_or_negative_c_m_t_are_usage_errors(flag, value):
    args = {"--save-seconds": "180", "--mtbf-hours": "24", "--interval-minutes": "60"}
    args[flag] = value
    done = ckptops_here(
        "goodput", "advise", "--restart-minutes", "10", *[x for kv in args.items() for x in kv]
    )
    assert done.exit_code == 2 and done.stderr.startswith("ckptops: ") and "positive" in done.stderr
    assert done.exception is None or isinstance(done.exception, SystemExit)


SIMULATE = {
    "--gpus": "5120",
    "--days": "76",
    "--mtbf-hours": "24",
    "--save-seconds": "180",
    "--interval-minutes": "90",
    "--recover-minutes": "10",
    "--runs": "10",
}


@pytest.mark.parametrize(
    "flag,value,named",
    [
        ("--recover-minutes", "nan", "restart_seconds"),
        ("--recover-minutes", "-1", "restart_seconds"),
        ("--save-seconds", "inf", "save_seconds"),
        ("--mtbf-hours", "nan", "mtbf_seconds"),
        ("--days", "1e6", "days"),
        ("--days", "nan", "days"),
        ("--runs", "1000000000", "runs"),
        ("--seed", "-1", "seed"),
        ("--gpus", "-5", "gpus"),
        ("--blocking-seconds", "nan", "blocking"),
    ],
)
def test_simulate_refuses_numbers_that_are_not_finite_or_in_range(flag, value, named):
    done = ckptops_here("goodput", "simulate", *[x for kv in (SIMULATE | {flag: value}).items() for x in kv])
    assert done.exit_code == 2 and done.stderr.startswith(f"ckptops: {named}: ")
    assert "%" not in done.stdout  # no ETTR printed from a NaN


def test_the_simulator_has_a_bound_on_events():
    # 3650 days with a save every minute in 1000 runs: billions of events, refused before any.
    done = ckptops_here(
        "goodput",
        "simulate",
        *[
            x
            for kv in (SIMULATE | {"--days": "3650", "--interval-minutes": "1", "--runs": "1000"}).items()
            for x in kv
        ],
    )
    assert done.exit_code == 2 and "saves and failures to simulate, more than 5,000,000" in done.stderr


@pytest.mark.parametrize(
    "flag,value,named",
    [("--restart-minutes", "nan", "restart_seconds"), ("--gpus", "-5", "gpus"), ("--gpus", "0", "gpus")],
)
def test_advise_refuses_a_nan_restart_and_gpus_below_one(flag, value, named):
    given = {
        "--save-seconds": "180",
        "--mtbf-hours": "24",
        "--restart-minutes": "10",
        "--interval-minutes": "60",
    }
    done = ckptops_here("goodput", "advise", *[x for kv in (given | {flag: value}).items() for x in kv])
    assert done.exit_code == 2 and done.stderr.startswith(f"ckptops: {named}: ")
    assert "GPU-hours" not in done.stdout and "ETTR" not in done.stdout


@pytest.mark.parametrize(
    "mtbf_hours,save,interval_minutes,restart_minutes",
    [(24, 180, 90.96, 10), (24, 180, 60, 10), (6, 60, 30, 5), (2, 30, 15, 2)],
)
def test_the_simulator_agrees_with_the_exact_closed_form(mtbf_hours, save, interval_minutes, restart_minutes):
    m, t, r = mtbf_hours * 3600, interval_minutes * 60, restart_minutes * 60
    found = simulate(8, 76, m, save, t, r, seed=7, runs=100)
    low, high = found.ettr_ci
    assert low <= ettr_exact(save, m, r, t) <= high
    assert found.failures_per_run == pytest.approx(76 * 86400 / (m + r + t / 2), rel=0.1)


def test_the_simulator_against_the_first_order_formula_at_the_seeds_parameters():
    """The first-order formula drops the cross terms of C/T, T/2M and R/M (their squares and
    products): it agrees with the simulation within the interval widened by that bound."""
    m, c, r = 86400.0, 180.0, 600.0
    t = daly(c, m)[0]
    found = simulate(5120, 76, m, c, t, r, seed=3, runs=100)
    low, high = found.ettr_ci
    bound = (c / t + t / (2 * m) + r / m) ** 2
    assert low - bound <= ettr(c, m, r, t) <= high + bound
    assert ettr(c, m, r, t) < low  # and it is a lower estimate: the bound is not idle


def test_without_failures_the_simulated_ettr_is_work_over_work_and_saves():
    found = simulate(8, 10, 1e12, 60, 600, 0, runs=3)
    assert found.ettr == pytest.approx(600 / 660, rel=1e-3) and found.failures_per_run == 0


def test_async_saves_lose_only_their_blocking_part():
    sync = simulate(8, 30, 86400, 180, 3600, 600, seed=1, runs=50)
    overlapped = simulate(8, 30, 86400, 180, 3600, 600, seed=1, runs=50, blocking=10)
    assert overlapped.ettr_ci[0] > sync.ettr_ci[1]
    with pytest.raises(UsageError, match="blocking"):
        simulate(8, 30, 86400, 180, 3600, 600, blocking=200)


def test_what_97_percent_takes():
    save = save_cost_for(0.97, 86400, 600)
    assert ettr(save, 86400, 600, daly(save, 86400)[0]) == pytest.approx(0.97, abs=1e-6)
    restart = restart_for(0.97, 86400, 10)
    assert ettr(10, 86400, restart, daly(10, 86400)[0]) == pytest.approx(0.97, abs=1e-9)
    assert restart_for(0.97, 86400, 180) is None  # at 3 min saves no recovery is fast enough


def steps(iterations, times, step_seconds, attempts) -> Steps:
    n = len(iterations)
    columns = {
        "iteration": np.array(iterations, dtype=float),
        "time": np.array(times, dtype=float),
        "step_seconds": np.array(step_seconds, dtype=float),
    }
    return Steps(
        "records.jsonl",
        "records",
        columns,
        np.array([None] * n, dtype=object),
        np.array(attempts, dtype=object),
    )


def test_productive_time_counts_the_surviving_lineage_and_losses_come_from_the_ledger():
    # Iterations 1-6, a failure, a resume from 4: 5 and 6 run twice and count once.
    found = steps(
        [1, 2, 3, 4, 5, 6, 5, 6, 7], [10, 11, 12, 13, 18, 19, 100, 101, 102], [1] * 9, ["a"] * 6 + ["b"] * 3
    )
    incident = Incident(
        "i1",
        "job",
        "event",
        times={
            "first_error": 20,
            "detected": 50,
            "approved": 60,
            "job_running": 80,
            "first_resumed_step": 99,
        },
        recomputed_iterations=2,
        outcome="completed",
        validation="VALIDATED",
    )
    ledger = measure("job", found, [incident], (save_times_from_records(found, 4), "held"))
    assert ledger.productive.seconds == 7 and ledger.wall.seconds == 102 - 9
    assert ledger.lost["saves"].seconds == 4  # after iteration 4 the loop was held 18 - 13 - 1 s
    assert [
        ledger.lost[c].seconds for c in ("detection", "triage and approval", "queue and relaunch", "start-up")
    ] == [
        30,
        10,
        20,
        18,  # running at 80, first step done at 99, less the mean step of 1 s
    ]
    assert ledger.lost["recomputation"].seconds == 2 and ledger.restart_seconds.seconds == 79
    assert ledger.ettr == pytest.approx(7 / 93) and ledger.mtbf.seconds == 93


def test_the_data_a_relaunch_skipped_is_reported_as_not_trained_apart_from_time():
    """Two relaunches past data failures (one before a batch-size ramp-up made its tokens
    unknown) and one that a person refused: the ledger names the iterations relaunches skipped,
    and their tokens only where every one is known."""
    found = steps([1, 2, 3], [10, 11, 12], [1] * 3, ["a"] * 3)
    skipped = Incident("i1", "job", "event", relaunched_job="local:1", outcome="completed")
    skipped.skipped = {"iterations": [6], "samples": [40, 48], "tokens": 256, "confirmed": True}
    refused = Incident("i2", "job", "event", outcome="aborted")
    refused.skipped = {"iterations": [9], "samples": [64, 72], "tokens": 256, "confirmed": False}
    stopped = Incident("i4", "job", "event", relaunched_job="local:3", outcome="stopped")
    stopped.skipped = {"iterations": [9], "samples": [64, 72], "tokens": 256, "confirmed": False}
    ledger = measure("job", found, [skipped, refused, stopped], ([], "no saves"))
    assert (ledger.untrained.iterations, ledger.untrained.tokens) == ([6], 256)
    assert "  not trained (data skipped): iterations 6, 256 tokens (incident ledger (1 relaunches" in (
        "\n".join(ledger_lines(ledger))
    )
    ramped = Incident("i3", "job", "event", relaunched_job="local:2", outcome="completed")
    ramped.skipped = {"iterations": [12, 13], "samples": None, "tokens": None, "confirmed": True}
    ledger = measure("job", found, [skipped, ramped], ([], "no saves"))
    assert ledger.untrained.iterations == [6, 12, 13] and ledger.untrained.tokens is None
    assert "iterations 12, 13 without a token count" in ledger.untrained.source
    # A later relaunch from an older checkpoint skips 6 again: it is not trained once, not twice.
    again = Incident("i5", "job", "event", relaunched_job="local:4", outcome="completed")
    again.skipped = {"iterations": [6, 9], "samples": None, "tokens": 512, "confirmed": True}
    assert measure("job", found, [skipped, again], ([], "no saves")).untrained.tokens == 512
    assert measure("job", found, [], ([], "no saves")).untrained.iterations == []


def test_a_preemptions_downtime_is_reported_apart_and_out_of_the_mtbf():
    """A recovery from a failure the infrastructure caused (the incident's infrastructure line):
    its downtime is its own line, none of the job's own causes, and the MTBF counts only the job's
    own failures."""
    found = steps(
        [1, 2, 3, 4, 5, 6, 5, 6, 7], [10, 11, 12, 13, 18, 19, 100, 101, 102], [1] * 9, ["a"] * 6 + ["b"] * 3
    )
    times = {"first_error": 20, "detected": 50, "approved": 60, "job_running": 80, "first_resumed_step": 99}
    own = Incident("i1", "job", "event", times=dict(times), outcome="completed")
    taken = Incident(
        "i2",
        "job",
        "event",
        times={k: v + 1 for k, v in times.items()},
        outcome="completed",
        infrastructure="*** JOB 7 ON n1 CANCELLED AT 2026-12-06T10:00:00 DUE TO PREEMPTION ***",
    )
    ledger = measure("job", found, [own, taken], ([], "no saves"))
    assert ledger.lost["infrastructure"].seconds == 79  # first error to first resumed step
    assert ledger.lost["detection"].seconds == 30 and ledger.lost["start-up"].seconds == 18  # i1's alone
    assert ledger.mtbf.seconds == 93 and "1 the infrastructure's apart" in ledger.mtbf.source
    assert ledger.incidents == 2
    (day,) = ledger.per_day
    assert day["infrastructure"] == pytest.approx(79 / 3600) and day["detection"] == pytest.approx(30 / 3600)


def test_missing_sources_are_not_measured_never_zero():
    ledger = measure("job", None, [], ([], "no save timer, step records or checkpoint files"))
    assert ledger.wall.seconds is None and ledger.productive.seconds is None and ledger.ettr is None
    assert ledger.lost["saves"].seconds is None and ledger.lost["saves"].source.startswith("not measured")
    assert ledger.mtbf.seconds is None and ledger.to_dict()["ettr_source"] == "not measured"


def test_save_times_from_megatron_timers_and_the_local_job():
    lines = [
        "(min, max) time across ranks (ms):",
        "    save-checkpoint ................................: (2561.08, 2561.37)",
        "saved checkpoint iteration 4 to /tmp/x/iter_0000004 in 0.07s",
        "    forward-backward ...............................: (310.11, 312.40)",
    ]
    assert read_save_log(lines).blocking == [pytest.approx(2.56137), 0.07]


def test_the_goodput_report_flow_publishes_the_ledger_and_warns_about_the_interval(
    prefect_api, trained, tmp_path
):
    from prefect.artifacts import Artifact

    from flows.goodput_report import goodput_report
    from tests.helpers.records import write_records

    save = shutil.copytree(trained, tmp_path / "checkpoints")
    records = write_records(tmp_path / "records.jsonl", iterations=range(1, 25), step_seconds=15.0)
    incident = Incident(
        "i1",
        "flowgood",
        "event",
        times={
            "first_error": 1000.0,
            "detected": 1300.0,
            "approved": 1400.0,
            "job_running": 1500.0,
            "first_resumed_step": 1800.0,
        },
        recomputed_iterations=2,
        outcome="completed",
    )
    record(save, incident)
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        yaml.safe_dump(
            {
                "job": {"name": "flowgood", "save_dir": str(save), "layout": {"data_parallel": 2}},
                "recovery": {
                    "launcher": "local",
                    "script": str(tmp_path / "job.sh"),
                    "step_records": str(records),
                },
            }
        )
    )
    state = goodput_report(profile=str(profile), return_state=True)
    assert state.is_completed() and "1 incidents" in state.message
    # A save every 4 iterations of 15 s is 1 min; this job's C (30 s) and M (9 min) advise 3.
    assert "differs from the job's (1.0 min)" in state.message
    rows = json.loads(Artifact.get("goodput-flowgood").data)
    assert {r["figure"] for r in rows} >= {"wall", "productive", "lost: saves", "MTBF"}
    assert "Young's interval" in Artifact.get("goodput-advice-flowgood").data
    assert not math.isnan(next(r["hours"] for r in rows if r["figure"] == "productive"))
