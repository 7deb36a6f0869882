"""The calendar (tasks.goodput.calendar): seed 001's arithmetic, the steady state past warm-up and
restarts, the projection from a real Megatron-LM log of the local job, day by day from records,
its bad input; the storage written a day in the interval advice; the flow's calendar artifact."""

import json
import re
import shutil
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
import yaml

from tasks.goodput.advice import advise, daly
from tasks.goodput.calendar import WARMUP_STEPS, daily, project, steady_throughput
from tasks.goodput.report import ledger
from tasks.goodput.snapshot import read_job
from tasks.job.step_records import load_steps
from tasks.profile import load_profile
from tests.helpers.records import write_records
from tests.test_cli import ckptops_here

START = datetime(2026, 1, 1, tzinfo=UTC).timestamp()


def test_seed_001s_arithmetic_10t_tokens_at_1_6m_tokens_per_second():
    found = project(0, 1.6e6, 0.9, 10e12, START)
    assert round(found.compute_days, 2) == 72.34 and round(found.wall_days, 2) == 80.38
    assert found.end_ts == pytest.approx(START + 10e12 / 1.6e6 / 0.9)


def test_the_cli_prints_seed_001s_calendar(tmp_path):
    profile = write_profile(tmp_path, tmp_path / "absent.jsonl")
    done = ckptops_here(
        "goodput", "calendar", "--target-tokens", "10e12", "--tokens-done", "0", "--tokens-per-second",
        "1.6e6", "--ettr", "0.9", "--start", "2026-01-01", "-p", profile,
    )  # fmt: skip
    assert done.exit_code == 0, done.stderr
    assert "72.34 days of compute" in done.stdout and "ETTR 90.00% (given): 80.38 days" in done.stdout
    assert "projected end 2026-03-22T09:00:44" in done.stdout  # 1 January + 80.3755 days


def test_seed_000s_storage_7_tb_hourly_is_168_tb_a_day(tmp_path):
    found = advise(180, 86400, 600, 3600, 5120, checkpoint_bytes=7e12)
    assert found.write_bytes_per_day_now == pytest.approx(168e12)
    assert found.write_bytes_per_day_advised == pytest.approx(7e12 * 86400 / daly(180, 86400)[0])
    profile = write_profile(tmp_path, tmp_path / "absent.jsonl")
    done = ckptops_here(
        "goodput", "advise", "--save-seconds", 180, "--mtbf-hours", 24, "--restart-minutes", 10,
        "--interval-minutes", 60, "--gpus", 5120, "--checkpoint-tb", 7, "-p", profile,
    )  # fmt: skip
    assert done.exit_code == 0, done.stderr
    assert (
        "storage written: 168.00 TB a day at the current interval, 110.82 TB a day at Daly's" in done.stdout
    )


def write_profile(tmp_path: Path, records: Path, save: Path | None = None, name: str = "cal") -> Path:
    profile = tmp_path / "profile.yaml"
    job = {"name": name, "save_dir": str(save or tmp_path / "checkpoints"), "layout": {"data_parallel": 2}}
    recovery = {"launcher": "local", "script": str(tmp_path / "job.sh"), "step_records": str(records)}
    profile.write_text(yaml.safe_dump({"job": job, "recovery": recovery}))
    return profile


def test_the_steady_state_leaves_out_warm_up_and_the_steps_after_a_restart(tmp_path):
    """Run a: 10 slow warm-up steps, 5 fast; run b resumes at 6 (10 slow, 2 fast). Counting the
    restart's slow steps as steady would make the median slow."""
    records = tmp_path / "records.jsonl"
    write_records(records, range(1, WARMUP_STEPS + 1), step_seconds=4.0, attempt="a")
    write_records(records, range(WARMUP_STEPS + 1, WARMUP_STEPS + 6), step_seconds=1.0, attempt="a")
    write_records(records, range(6, WARMUP_STEPS + 6), step_seconds=4.0, attempt="b")
    write_records(records, range(WARMUP_STEPS + 6, WARMUP_STEPS + 8), step_seconds=1.0, attempt="b")
    tps, source = steady_throughput(load_steps(records), None)
    assert tps == 256.0 and "median of 7 steps" in source  # 256 tokens a step of 1 s


def trained_log(trained: Path) -> Path:
    return trained.parent / f"{trained.name}-train.log"


def log_lines(log: Path) -> list[tuple[float, float, float]]:
    """(consumed samples, elapsed ms, global batch) per iteration line, read here on its own."""
    found = []
    for line in log.read_text().splitlines():
        if not re.search(r"\] iteration\s+\d+/", line):
            continue
        fields = {}
        for part in line.split("|")[1:]:
            name, _, value = part.partition(":")
            fields[name.strip()] = value.strip()
        names = ("consumed samples", "elapsed time per iteration (ms)", "global batch size")
        found.append(tuple(float(fields[name]) for name in names))
    return found


def test_the_calendar_of_the_local_jobs_megatron_log(trained, tmp_path):
    from tasks.checkpoint.facts import checkpoint_facts

    save = shutil.copytree(trained, tmp_path / "checkpoints")
    profile = write_profile(tmp_path, tmp_path / "absent.jsonl", save)
    seq = checkpoint_facts(save / "iter_0000024").seq_length
    lines = log_lines(trained_log(trained))
    done = lines[-1][0] * seq
    tps = float(np.median([batch / (ms / 1000) * seq for _, ms, batch in lines[WARMUP_STEPS:]]))
    ettr = ledger(read_job(load_profile(str(profile)), trained_log(trained))).ettr
    assert len(lines) > WARMUP_STEPS and 0 < ettr < 1
    target = 10 * done
    result = ckptops_here(
        "goodput", "calendar", "--target-tokens", target, "--log", trained_log(trained),
        "--start", "2026-01-01", "-p", profile, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["tokens_done"] == done and found["tokens_per_second"] == pytest.approx(tps)
    assert "samples/s x sequence length" in found["throughput_source"]
    assert found["projection"]["ettr"] == pytest.approx(ettr)
    assert found["projection"]["end_ts"] == pytest.approx(START + (target - done) / tps / ettr)
    # The last day's projection is the same figure, from the time of the last line.
    at = float(np.nanmax(load_steps(trained_log(trained)).time))
    assert found["days"][-1]["end_ts"] == pytest.approx(project(done, tps, ettr, target, at).end_ts)
    # The advice beside it: no incident, so no MTBF measured: said, not guessed.
    assert found["advised"] is None and "mtbf: not measured" in found["advised_note"]
    # The storage written a day: the newest checkpoint's size, a save a minute.
    advice = ckptops_here(
        "goodput", "advise", "--save-seconds", 1, "--mtbf-hours", 1, "--restart-minutes", 1,
        "--interval-minutes", 1, "-p", profile, "--json",
    )  # fmt: skip
    data = json.loads(advice.stdout)
    size = sum(p.stat().st_size for p in (save / "iter_0000024").iterdir() if p.is_file())
    assert data["checkpoint_bytes"] == size and data["write_bytes_per_day_now"] == pytest.approx(size * 1440)


def test_goodput_options_reach_the_subcommand_and_the_save_cost_is_megatron_lms_timer(trained, tmp_path):
    """Options given before the subcommand are the subcommand's (or refused); every output names
    the job and the profile; the save cost C is Megatron-LM's save-checkpoint timer in the job's
    log, never the checkpoints' file times (ckptops's own manifests are written after them)."""
    save = shutil.copytree(trained, tmp_path / "checkpoints")
    profile = write_profile(tmp_path, tmp_path / "absent.jsonl", save, name="mine")
    log = trained_log(trained)
    timers = [
        float(m[1]) / 1000
        for m in re.finditer(r"save-checkpoint \.*: \([0-9.]+, ([0-9.]+)\)", log.read_text())
    ]
    assert timers  # Megatron-LM's own timer, one per save
    given = ("--mtbf-hours", 1, "--restart-minutes", 1, "--interval-minutes", 1)
    done = ckptops_here("goodput", "-p", profile, "--log", log, "advise", *given, "--json")
    assert done.exit_code == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["job"] == "mine" and found["profile"] == str(profile)
    assert found["save_seconds"] == pytest.approx(float(np.median(timers)))
    assert found["sources"]["save"] == f"save timers in {log}"
    # Without the log there is no timer to read: not measured, and the flag to give is named.
    done = ckptops_here("goodput", "-p", profile, "advise", *given)
    assert (
        done.exit_code == 2
        and "not measured for mine" in done.stderr
        and "give --save-seconds" in done.stderr
    )
    text = ckptops_here("goodput", "-p", profile, "--log", log)
    assert text.exit_code == 0 and text.stdout.startswith(f"job mine (profile {profile})")
    assert "lost to saves: not measured" not in text.stdout and f"save timers in {log}" in text.stdout
    # An option the subcommand does not use, or one given twice, is refused, never dropped.
    refused = ckptops_here(
        "goodput", "--since", "2026-01-01", "calendar", "--target-tokens", 1e6, "-p", profile
    )
    assert refused.exit_code == 2 and "goodput --since: not used by 'goodput calendar'" in refused.stderr
    twice = ckptops_here("goodput", "-p", "local", "calendar", "--target-tokens", 1e6, "-p", profile)
    assert twice.exit_code == 2 and "give it once" in twice.stderr
    calendar = ckptops_here("goodput", "-p", profile, "calendar", "--target-tokens", 1e6, "--log", log)
    assert calendar.exit_code == 0 and calendar.stdout.startswith(f"job mine (profile {profile})")


def test_the_projection_day_by_day_from_records_spanning_days(tmp_path):
    records = write_records(
        tmp_path / "records.jsonl", range(1, 400), step_seconds=600.0, start=START, save_seconds=60.0
    )
    steps = load_steps(records)
    target = 1e6
    days = daily(steps, None, target)
    assert [d["day"] for d in days] == ["2026-01-01", "2026-01-02", "2026-01-03"]  # 2.8 days
    assert all(d["end"] for d in days)
    assert [d["tokens_done"] for d in days] == sorted(d["tokens_done"] for d in days)
    end_of_first = START + 86400
    rows = np.nonzero(steps.time <= end_of_first)[0]
    first = days[0]
    assert first["tokens_done"] == 256 * rows.size  # every record ran 256 tokens
    assert first["ettr"] < 1  # the saves held the loop
    assert first["end"] == project(256 * rows.size, 256 / 600, first["ettr"], target, end_of_first).end
    # The CLI's headline from the last record's time is the last day's projection.
    profile = write_profile(tmp_path, records)
    last_time = datetime.fromtimestamp(float(steps.time[-1]), UTC).isoformat()
    done = ckptops_here(
        "goodput", "calendar", "--target-tokens", target, "--start", last_time, "-p", profile, "--json"
    )
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout)["projection"]["end_ts"] == pytest.approx(days[-1]["end_ts"])


def test_the_end_date_at_the_advised_interval_moves_the_measured_ettr_by_the_predicted_gain(tmp_path):
    records = write_records(
        tmp_path / "records.jsonl", range(1, 400), step_seconds=600.0, start=START, save_seconds=60.0
    )
    profile = write_profile(tmp_path, records)
    done = ckptops_here(
        "goodput", "calendar", "--target-tokens", 1e6, "--start", "2026-01-01", "--save-seconds", 60,
        "--mtbf-hours", 24, "--restart-minutes", 10, "--interval-minutes", 40, "-p", profile, "--json",
    )  # fmt: skip
    assert done.exit_code == 0, done.stderr
    found = json.loads(done.stdout)
    predicted = advise(60, 86400, 600, 2400, 2)
    assert predicted.ettr_advised > predicted.ettr_now  # 40 min is short of Daly's interval here
    ettr = found["projection"]["ettr"] + predicted.ettr_advised - predicted.ettr_now
    assert found["advised"]["ettr"] == pytest.approx(ettr)
    remaining = (1e6 - found["tokens_done"]) / found["tokens_per_second"]
    assert found["advised"]["end_ts"] == pytest.approx(START + remaining / ettr)
    assert found["advised"]["end_ts"] < found["projection"]["end_ts"]


def records(tmp_path: Path) -> Path:
    return write_records(tmp_path / "r.jsonl", range(1, 30), step_seconds=1.0)


def no_tokens(tmp_path: Path) -> Path:
    records = tmp_path / "records.jsonl"
    write_records(records, range(1, 30), step_seconds=1.0)
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    for row in rows:
        del row["consumed_samples"], row["tokens_per_second"]
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return records


@pytest.mark.parametrize(
    "make,target,says",
    [
        (lambda tmp: tmp / "absent.jsonl", "1e6", "no step records or log to measure from"),
        (no_tokens, "1e6", "no tokens so far in it"),
        (lambda tmp: records(tmp), "1000", "the target is reached"),
        (lambda tmp: records(tmp), "0", "--target-tokens"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tmp_path, make, target, says):
    profile = write_profile(tmp_path, make(tmp_path))
    done = ckptops_here("goodput", "calendar", "--target-tokens", target, "-p", profile)
    assert done.exit_code == 2 and done.stdout == ""
    assert done.stderr.startswith("ckptops: ") and says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_goodput_report_flow_publishes_the_calendar(prefect_api, trained, tmp_path, monkeypatch):
    """The flow reads the job once a run, for the ledger, the advice and the calendar."""
    from prefect.artifacts import Artifact

    from flows.goodput_report import goodput_report

    save = shutil.copytree(trained, tmp_path / "checkpoints")
    records = write_records(tmp_path / "records.jsonl", range(1, 400), step_seconds=600.0, start=START)
    profile = write_profile(tmp_path, records, save, name="flowcal")
    reads = job_reads(monkeypatch)
    state = goodput_report(profile=str(profile), target_tokens=1e6, return_state=True)
    assert state.is_completed() and "projected end 20" in state.message
    assert counts(reads) == dict.fromkeys(reads, 1)
    text = Artifact.get("goodput-calendar-flowcal").data
    assert "days of compute" in text and "data:image/png;base64," in text
    # Without a target: no calendar, the rest as before.
    state = goodput_report(profile=str(profile), return_state=True)
    assert state.is_completed() and "projected end" not in state.message


def counted(monkeypatch, function) -> list:
    """The calls of ``function`` from here on, the real function still answering them, wherever
    a loaded module bound it (and where a module imported later will find it)."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is function:
                monkeypatch.setattr(module, name, counting)
    return calls


def job_reads(monkeypatch) -> dict[str, list]:
    """The calls of each reader of the job from here on: its step records (or log), the pointer
    to its newest checkpoint, that checkpoint's facts (a torch.load of the common state and a
    signature check), its incident ledger."""
    from tasks.checkpoint.facts import checkpoint_facts
    from tasks.checkpoint.pointer import read_pointer
    from tasks.job.step_records import load_steps
    from tasks.recovery.ledger import read_ledger

    readers = (load_steps, read_pointer, checkpoint_facts, read_ledger)
    return {reader.__name__: counted(monkeypatch, reader) for reader in readers}


def counts(reads: dict[str, list]) -> dict[str, int]:
    return {name: len(calls) for name, calls in reads.items()}


def test_goodput_calendar_reads_the_job_once(trained, tmp_path, monkeypatch):
    """One snapshot of the job a command: each of its sources read once, for the ledger, the
    advice and the calendar together."""
    save = shutil.copytree(trained, tmp_path / "checkpoints")
    records = write_records(tmp_path / "records.jsonl", range(1, 400), step_seconds=600.0, start=START)
    profile = write_profile(tmp_path, records, save)
    reads = job_reads(monkeypatch)
    done = ckptops_here(
        "goodput", "calendar", "--target-tokens", 1e6, "--save-seconds", 60, "--mtbf-hours", 24,
        "--restart-minutes", 10, "-p", profile, "--json",
    )  # fmt: skip
    assert done.exit_code == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["advised"] is not None and "sequence length" in found["tokens_source"]
    assert counts(reads) == dict.fromkeys(reads, 1)
