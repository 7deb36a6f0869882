"""Post-resume validation end to end: a real run killed between saves, resumed from the promoted
checkpoint, validated; and each way a resume goes wrong, caught and named by its check."""

import json
import re
import shutil
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from infra.local_job.dataset import build as build_dataset
from infra.local_job.launch import PRETRAIN, run_local_job
from tasks.checkpoint.pointer import POINTER, read_pointer
from tasks.checkpoint.promote import promote
from tasks.checkpoint.state import VerifyOptions
from tasks.errors import CkptopsError, UsageError
from tasks.events import RESUME_VALIDATED, job_resource
from tasks.job.step_records import load_steps
from tasks.profile import load_profile
from tasks.resume.validate import validate_resume
from tests.conftest import ROOT
from tests.helpers.poll import until

CORE_LOOP = ROOT / "tests" / "helpers" / "core_loop.py"
SETTINGS = load_profile().resume  # the embedded default's windows and tolerances
MEGATRON = Path(__file__).parent / "data" / "megatron"


def killed_between_saves(root: Path, extra: tuple = (), entry: Path = PRETRAIN) -> tuple[Path, Path]:
    """24 planned iterations, a checkpoint every 4; rank 1 is SIGKILLed before iteration 15, so
    the run dies between the saves at 12 and 16; then verify-and-promote runs."""
    save = root / "checkpoints"
    with pytest.raises(CkptopsError, match="exited"):
        run_local_job(
            save,
            train_iters=24,
            save_interval=4,
            timeout_seconds=600,
            extra=["--step-records", str(root / "before.jsonl"), "--fail-at", "1:15:kill", *extra],
            entry=entry,
        )
    promote(save, VerifyOptions(job="resume-test"), 30)
    return root, save


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    """24 planned iterations, a checkpoint every 4; rank 1 is SIGKILLed before iteration 15, so
    the run dies between the saves at 12 and 16. Then verify-and-promote picks iteration 12."""
    root, save = killed_between_saves(tmp_path_factory.mktemp("failed-run"))
    assert read_pointer(save) == 12
    before = load_steps(root / "before.jsonl")
    assert before.iteration[-1] == 14  # the run got two iterations past the checkpoint
    return root, save


def resume(failed_run, name: str, step: int = 12, extra: tuple = ()) -> Path:
    """Resume the failed run from a checkpoint (a copy of the save directory per variant)."""
    root, save = failed_run
    records = root / f"{name}.jsonl"
    run_local_job(
        root / f"save-{name}",
        train_iters=24,
        save_interval=1000,
        timeout_seconds=600,
        log=root / f"{name}.log",
        extra=["--load", str(save), "--ckpt-step", str(step), "--step-records", str(records), *extra],
    )
    return records


@pytest.fixture(scope="module")
def good_resume(failed_run) -> Path:
    """The failed run resumed from its promoted checkpoint, as it should be: its step records,
    trained once for every test that needs a correct resume (they read it, never write it)."""
    return resume(failed_run, "good")


def validate(failed_run, after: Path, before: bool = True):
    root, save = failed_run
    return validate_resume(
        save / "iter_0000012",
        load_steps(root / "before.jsonl") if before else None,
        load_steps(after),
        SETTINGS,
    )


def failed_checks(result) -> list[str]:
    return [c.name for c in result.failures]


def test_resume_from_the_promoted_checkpoint_continues_exactly(failed_run, good_resume, tmp_path):
    result = validate(failed_run, good_resume)
    assert result.ok, result.line()
    checks = {c.name: c for c in result.checks}
    assert checks["resume point"].observed == "iteration 13 after 96 samples"
    assert checks["loss and grad norm"].expected == "2 recomputed iterations bit-exact"
    assert checks["data order"].ok and checks["learning rate"].ok
    assert checks["peak memory"].ok and checks["throughput"].ok and checks["skipped and NaN iterations"].ok
    assert checks["promoted checkpoint"].ok
    # The baseline is now stored with the job: a later validation works without the old records,
    # but without them the recomputed steps cannot be compared: not passed, not checkable.
    later = validate(failed_run, good_resume, before=False)
    assert later.ok and {c.name for c in later.checks if c.outcome == "unchecked"} == {
        "loss and grad norm",
        "data order",
        "data version",  # mock data: no dataset indices
    }
    # A file the resumed job appended a second attempt to: the last attempt is the one judged.
    appended = tmp_path / "appended.jsonl"
    appended.write_text(good_resume.read_text() * 2)
    assert validate(failed_run, appended).ok


def test_another_data_seed_is_caught_by_data_order(failed_run):
    result = validate(failed_run, resume(failed_run, "seed", extra=("--seed", "999")))
    assert not result.ok and failed_checks(result)[0] == "data order"
    assert "loss and grad norm" in failed_checks(result)


@pytest.fixture(scope="module")
def no_optim_resume(failed_run) -> Path:
    """The failed run resumed without its optimizer and scheduler (``--no-load-optim``)."""
    return resume(failed_run, "no-optim", extra=("--no-load-optim",))


def test_resume_without_optimizer_and_scheduler_is_caught_by_learning_rate(failed_run, no_optim_resume):
    result = validate(failed_run, no_optim_resume)
    assert not result.ok and failed_checks(result)[0] == "learning rate"
    assert result.line().startswith("REJECTED resume from iteration 12: learning rate: expected ")


def test_a_resume_made_before_ckptops_ran_leaves_the_pointer_unchecked_and_a_wrong_one_names_its_fault(
    failed_run, good_resume, no_optim_resume, tmp_path
):
    """ckptops brought in after the job resumed: its first promotion is later than the resume.
    Which checkpoint was promoted then is not known (unchecked, saying why), so the correct resume
    is validated and the wrong one is rejected by its own fault, the learning rate."""
    root, save = failed_run
    late = shutil.copytree(save, tmp_path / "checkpoints")
    shutil.rmtree(late / ".ckptops-history")
    (late / POINTER).unlink()
    for manifest in late.glob("iter_*/manifest.*"):
        manifest.unlink()
    promote(late, VerifyOptions(job="resume-test"), 30)
    before = load_steps(root / "before.jsonl")

    good = validate_resume(late / "iter_0000012", before, load_steps(good_resume), SETTINGS)
    assert good.ok, good.line()
    promoted = next(c for c in good.checks if c.name == "promoted checkpoint")
    assert promoted.outcome == "unchecked"
    assert "resumed before the pointer's history begins" in promoted.detail
    wrong = validate_resume(late / "iter_0000012", before, load_steps(no_optim_resume), SETTINGS)
    assert wrong.line().startswith("REJECTED resume from iteration 12: learning rate: "), wrong.line()


def test_resume_from_another_checkpoint_is_caught_by_resume_point(failed_run):
    result = validate(failed_run, resume(failed_run, "older", step=8))
    assert failed_checks(result) == ["resume point"]
    assert result.failures[0].observed == "first iteration 9"
    # Told the checkpoint it really resumed from, the validator names what is wrong with it.
    root, save = failed_run
    honest = validate_resume(
        save / "iter_0000008", load_steps(root / "before.jsonl"), load_steps(root / "older.jsonl"), SETTINGS
    )
    assert failed_checks(honest)[0] == "promoted checkpoint"
    assert honest.failures[0].expected == "iteration 12 (latest verified when the run resumed)"


def test_resume_point_still_passes_after_the_resumed_run_promoted_its_own_saves(failed_run, tmp_path):
    """The resumed run saves into the same directory and moves the pointer on; validating later,
    with or without the records from before, must still accept the resume from 12."""
    root, save = failed_run
    shutil.copytree(save, tmp_path / "checkpoints")
    save = tmp_path / "checkpoints"
    records = tmp_path / "after.jsonl"
    # Stopped by Megatron-LM's own --exit-interval (a changed --train-iters would not resume: the
    # scheduler's weight-decay steps are saved with the checkpoint).
    run_local_job(
        save,
        train_iters=24,
        save_interval=4,
        timeout_seconds=600,
        log=tmp_path / "train.log",
        extra=[
            "--load",
            str(save),
            "--ckpt-step",
            "12",
            "--step-records",
            str(records),
            "--exit-interval",
            "20",
        ],
    )
    promote(save, VerifyOptions(job="resume-test"), 30)
    assert read_pointer(save) == 20
    for before in (load_steps(root / "before.jsonl"), None):
        checks = {
            c.name: c
            for c in validate_resume(save / "iter_0000012", before, load_steps(records), SETTINGS).checks
        }
        assert checks["promoted checkpoint"].ok, checks["promoted checkpoint"]
        assert checks["promoted checkpoint"].expected == "iteration 12 (latest verified when the run resumed)"
    # Records without times (as from logs): the save directory and the failed run's end decide.
    timeless = tmp_path / "timeless.jsonl"
    timeless.write_text(
        "".join(
            json.dumps({k: v for k, v in json.loads(line).items() if k != "time"}) + "\n"
            for line in records.read_text().splitlines()
        )
    )
    with_before = validate_resume(
        save / "iter_0000012", load_steps(root / "before.jsonl"), load_steps(timeless), SETTINGS
    )
    check = next(c for c in with_before.checks if c.name == "promoted checkpoint")
    assert check.ok and check.expected == "iteration 12 (latest verified up to the failure at 14)"
    alone = validate_resume(save / "iter_0000012", None, load_steps(timeless), SETTINGS)
    check = next(c for c in alone.checks if c.name == "promoted checkpoint")
    assert check.outcome == "unchecked" and "not checkable" in check.detail


def test_slow_resumed_run_is_caught_by_throughput(failed_run):
    # Slower by far more than two shared cores' load swings: a baseline the suite's busiest minute
    # slowed to 400 ms a step must still look fast beside it (the local band allows 60% slower).
    result = validate(failed_run, resume(failed_run, "slow", extra=("--slow-step-ms", "1500")))
    assert failed_checks(result) == ["throughput"]


def test_resumed_run_using_more_memory_is_caught_by_peak_memory(failed_run):
    result = validate(failed_run, resume(failed_run, "ballast", extra=("--ballast-mb", "400")))
    assert failed_checks(result) == ["peak memory"]


def test_cli_tells_records_from_megatron_logs(failed_run, good_resume, tmp_path):
    root, save = failed_run
    records = good_resume
    # Synthetic: Megatron-LM's training-log format (tests/data/megatron) written from our records.
    _as_megatron_log(root / "before.jsonl", tmp_path / "before.log")
    _as_megatron_log(records, tmp_path / "after.log")
    done = subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "ckptops"),
            "validate-resume",
            "--checkpoint",
            str(save / "iter_0000012"),
            "--before",
            str(tmp_path / "before.log"),
            "--after",
            str(tmp_path / "after.log"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(done.stdout)
    checks = {c["name"]: c for c in data["checks"]}
    assert done.returncode == 0, data
    assert checks["data order"]["outcome"] == "unchecked" and checks["learning rate"]["outcome"] == "pass"
    # The log's iteration lines carry their times: the pointer when the run resumed is known.
    assert checks["promoted checkpoint"] == checks["promoted checkpoint"] | {
        "outcome": "pass",
        "expected": "iteration 12 (latest verified when the run resumed)",
    }
    missing = subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "ckptops"),
            "validate-resume",
            "--checkpoint",
            str(save / "iter_0000012"),
            "--after",
            str(tmp_path / "nope.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr


def test_megatron_lm_log_lines_are_parsed():
    steps = load_steps(MEGATRON / "megatron_lm_issue756.log")
    assert steps.kind == "megatron-log" and steps.iteration.tolist() == [2, 3]
    assert steps.consumed.tolist() == [256, 384] and steps.lr.tolist() == [4e-07, 6e-07]
    assert steps.loss.tolist() == [2.02153, 2.003316] and steps.grad_norm.tolist() == [6.895, 6.603]
    assert steps.step_seconds.tolist() == pytest.approx([5.6301, 5.4106])
    # samples/s from the global batch size and the elapsed time, not the TFLOP/s column
    assert steps.throughput_unit == "samples/s" and steps.throughput.tolist() == pytest.approx(
        [128 / 5.6301, 128 / 5.4106]
    )
    assert steps.peak_memory[0] == int(54250.98583984375 * 1024 * 1024) and steps.batch_count.tolist() == [
        128,
        128,
    ]
    older = load_steps(MEGATRON / "megatron_llm_issue11.log")
    assert older.iteration.tolist() == [122, 123, 124, 125]
    assert older.consumed[-1] == 128000 and older.lr[0] == 9.15e-06


def test_post_resume_validation_flow_emits_its_event(failed_run, good_resume, prefect_api, tmp_path):
    from prefect.artifacts import Artifact
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter

    from flows.post_resume_validation import post_resume_validation

    root, save = failed_run
    records = good_resume
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        f"job: {{name: resume-test, save_dir: '{save}'}}\n"
        "resume: {warmup_steps: 3, window_steps: 20, min_steps: 5, loss_rel_tolerance: 0.0, "
        "memory_band: 0.15, throughput_drop: 0.6}\n"
    )
    state = post_resume_validation(
        after=str(records), before=str(root / "before.jsonl"), profile=str(profile), return_state=True
    )
    assert state.is_completed() and state.message.startswith("VALIDATED resume from iteration 12")
    rows = json.loads(Artifact.get("resume-checks-resume-test").data)
    assert [r["check"] for r in rows][:6] == [
        "promoted checkpoint",
        "resume point",
        "learning rate",
        "data order",
        "data version",
        "loss and grad norm",
    ]
    # Events reach the server asynchronously: poll (bounded) until it has stored this one.
    with get_client(sync_client=True) as client:

        def recorded() -> bool:
            page = client.read_events(
                filter=EventFilter(event=EventNameFilter(name=[RESUME_VALIDATED])), limit=50
            )
            return any(e.resource.id == job_resource("resume-test") for e in page.events)

        until(recorded, 60, f"{RESUME_VALIDATED} recorded for {job_resource('resume-test')}")


def _as_megatron_log(records: Path, target: Path, tflops: bool = True) -> Path:
    """Megatron-LM's training-log format (tests/data/megatron) written from our records; without
    ``tflops``, as Megatron-LM prints it when not run with --log-throughput."""
    lines, previous = [], None
    for line in records.read_text().splitlines():
        r = json.loads(line)
        if r["iteration"] > 1 and (previous is None or r["iteration"] <= previous):
            # A run from a checkpoint: Megatron-LM's load line (0.19's wording) comes first.
            lines.append(
                f"  successfully loaded checkpoint from {records.parent} [ t 1/1, gtp_remat 1/1, p 1/1 ] "
                f"at iteration {r['iteration'] - 1}"
            )
        previous = r["iteration"]
        throughput = f"throughput per GPU (TFLOP/s/GPU): {r['tflops']:.1f} | " if tflops else ""
        lines.append(
            f" [{datetime.fromtimestamp(r['time']):%Y-%m-%d %H:%M:%S.%f}] "
            f"iteration {r['iteration']:8d}/      30 | consumed samples: "
            f"{r['consumed_samples']:12d} | "
            f"elapsed time per iteration (ms): {r['step_seconds'] * 1000:.1f} | "
            f"{throughput}learning rate: {r['lr']:E} | global batch size: {r['batch']['count']:5d} | "
            f"lm loss: {r['loss']:E} | loss scale: 1.0 | grad norm: {r['grad_norm']:.3f} | "
            "number of skipped iterations:   0 | number of nan iterations:   0 |"
        )
    target.write_text("\n".join(lines) + "\n")
    return target


def test_standard_megatron_lm_logs_are_compared_in_tokens_per_second(failed_run, good_resume, tmp_path):
    """Without --log-throughput a Megatron-LM log has no TFLOP/s; elapsed time and global batch
    size give samples/s, and the checkpoint's sequence length tokens/s: comparable with records."""
    root, save = failed_run
    records = good_resume
    before = _as_megatron_log(root / "before.jsonl", tmp_path / "before.log", tflops=False)
    after = _as_megatron_log(records, tmp_path / "after.log", tflops=False)
    result = validate_resume(save / "iter_0000012", load_steps(before), load_steps(after), SETTINGS)
    check = next(c for c in result.checks if c.name == "throughput")
    assert check.outcome == "pass" and "tokens/s" in check.expected, check
    # A log against a records baseline (both in tokens/s now) is just as comparable.
    mixed = validate_resume(
        save / "iter_0000012", load_steps(root / "before.jsonl"), load_steps(after), SETTINGS
    )
    assert next(c for c in mixed.checks if c.name == "throughput").outcome == "pass"
    older = load_steps(MEGATRON / "megatron_llm_issue11.log")
    assert older.throughput_unit == "samples/s" and older.throughput[0] == pytest.approx(1024 / 86.5452)


def test_a_loss_that_diverged_to_infinity_is_caught(failed_run, good_resume, tmp_path):
    root, save = failed_run
    records = good_resume
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    lines[-3]["loss"] = float("inf")  # beyond the recomputed steps; the job's NaN flag missed it
    diverged = tmp_path / "diverged.jsonl"
    diverged.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = validate(failed_run, diverged)
    assert failed_checks(result) == ["skipped and NaN iterations"]
    assert f"iteration {lines[-3]['iteration']}: 0 skipped, 0 NaN, loss inf" in result.failures[0].observed
    logged = _as_megatron_log(diverged, tmp_path / "diverged.log")
    assert "lm loss: INF" in logged.read_text()
    from_log = validate_resume(
        save / "iter_0000012", load_steps(root / "before.jsonl"), load_steps(logged), SETTINGS
    )
    assert "skipped and NaN iterations" in failed_checks(from_log)


@pytest.fixture(scope="module")
def per_iteration_run(tmp_path_factory):
    """A loop that is not Megatron-LM's (tests/helpers/core_loop.py) and steps its LR scheduler
    once per iteration, killed between saves like the other."""
    extra = ("--scheduler-per-iteration", "--lr-warmup-samples", "64", "--lr-decay-samples", "400")
    root, save = killed_between_saves(tmp_path_factory.mktemp("per-iteration"), extra, CORE_LOOP)
    run_local_job(
        root / "resumed",
        train_iters=24,
        save_interval=1000,
        timeout_seconds=600,
        log=root / "resumed.log",
        extra=["--load", str(save), "--step-records", str(root / "after.jsonl"), *extra],
        entry=CORE_LOOP,
    )
    return root, save


def test_a_scheduler_stepped_per_iteration_is_replayed_in_iterations(per_iteration_run):
    root, save = per_iteration_run
    # Not a throughput test: the two runs trained minutes apart on two shared cores (the resumed
    # one was once 3.6 times slower), so the throughput band is opened; the rest is as configured.
    settings = SETTINGS.model_copy(update={"throughput_drop": 0.99})
    result = validate_resume(
        save / "iter_0000012", load_steps(root / "before.jsonl"), load_steps(root / "after.jsonl"), settings
    )
    assert result.ok, result.line()
    check = next(c for c in result.checks if c.name == "learning rate")
    assert (
        check.expected
        == "2 recomputed as before, 10 on the checkpoint's schedule (the scheduler counts iterations)"
    )


def test_a_checkpoint_never_verified_is_verified_on_the_spot(per_iteration_run, tmp_path):
    from tasks.resume.validate import validate as validate_run

    root, save = per_iteration_run
    copy = shutil.copytree(save, tmp_path / "checkpoints")
    (copy / "iter_0000012" / "manifest.json").unlink()  # the run resumed before verification did
    profile = tmp_path / "p.yaml"
    profile.write_text(
        f"job: {{name: resume-test, save_dir: '{copy}', layout: {{data_parallel: 2}}}}\n"
        "resume: {throughput_drop: 0.9}\n"
    )
    result = validate_run(
        load_profile(profile), root / "after.jsonl", root / "before.jsonl", copy / "iter_0000012"
    )
    check = next(c for c in result.checks if c.name == "promoted checkpoint")
    assert (
        result.ok and check.outcome == "warn" and "was verified after the resume (it passed)" in check.detail
    )
    assert (copy / "iter_0000012" / "manifest.json").exists()
    broken = shutil.copytree(save, tmp_path / "broken")
    (broken / "iter_0000012" / "manifest.json").unlink()
    (broken / "iter_0000012" / "__1_0.distcp").unlink()
    profile.write_text(f"job: {{name: resume-test, save_dir: '{broken}', layout: {{data_parallel: 2}}}}\n")
    rejected = validate_run(
        load_profile(profile), root / "after.jsonl", root / "before.jsonl", broken / "iter_0000012"
    )
    assert not rejected.ok and rejected.failures[0].name == "promoted checkpoint"
    assert (
        "its manifest says invalid: __1_0.distcp: referenced by .metadata but missing"
        in rejected.failures[0].observed
    )


def test_a_bit_exact_resume_validates_from_megatron_lms_own_logs(failed_run, good_resume):
    """The logs Megatron-LM's loop printed itself (not records): the correct resume validates
    with a loss tolerance of 0. The second line after the start prints a mean over other
    iterations than the first run's line there (0.19's accumulator), so that loss is left out
    and the check says so; every grad norm is compared."""
    root, save = failed_run
    before, after = load_steps(root / "checkpoints-train.log"), load_steps(root / "good.log")
    assert before.kind == after.kind == "megatron-log"
    assert SETTINGS.loss_rel_tolerance == 0
    result = validate_resume(save / "iter_0000012", before, after, SETTINGS)
    assert result.ok, result.line()
    loss = next(c for c in result.checks if c.name == "loss and grad norm")
    assert loss.observed == (
        "as expected (1 losses and 2 grad norms compared; loss not compared at 14 "
        "(printed over other iterations than before); a log's values to the precision it printed; "
        "largest relative difference 0)"
    )
    # The lines' own timestamps place the resume: the pointer when it started was 12.
    promoted = next(c for c in result.checks if c.name == "promoted checkpoint")
    assert promoted.ok and promoted.expected == "iteration 12 (latest verified when the run resumed)"


def test_another_seed_is_rejected_from_megatron_lms_own_logs(failed_run):
    root, save = failed_run
    resume(failed_run, "seed-log", extra=("--seed", "999"))
    result = validate_resume(
        save / "iter_0000012",
        load_steps(root / "checkpoints-train.log"),
        load_steps(root / "seed-log.log"),
        SETTINGS,
    )
    assert not result.ok and failed_checks(result)[0] == "loss and grad norm"
    assert "grad norm" in result.failures[0].expected


def test_goodput_from_megatron_lms_own_log_alone(failed_run):
    """A real Megatron-LM log, and no records: wall time from the lines' timestamps, productive
    time from their step times, and ETTR."""
    from tests.test_cli import ckptops_here

    root, save = failed_run
    profile = root / "goodput-profile.yaml"
    profile.write_text(f"job: {{name: resume-test, save_dir: '{save}'}}\n")
    done = ckptops_here("goodput", "--log", root / "checkpoints-train.log", "--profile", profile, "--json")
    assert done.exit_code == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["wall"]["seconds"] > 0 and "checkpoints-train.log" in found["wall"]["source"]
    assert 0 < found["productive"]["seconds"] < found["wall"]["seconds"]
    assert 0 < found["ettr"] < 1


def test_the_last_ranks_log_without_the_load_line_is_placed_by_its_first_iteration_and_samples(
    failed_run, good_resume, tmp_path
):
    """Megatron-LM prints 'successfully loaded checkpoint ... at iteration N' on rank 0 and the
    iteration lines on the last rank: with per-rank output files (srun --output=%t.log) the last
    rank's file never has the load line. The correct resume's own log without it validates, by
    its first iteration (13) and consumed samples (96 + that iteration's batch); one whose
    samples do not follow from the checkpoint's, or whose load line names another iteration, is
    rejected. A drill's continuation, whose whole log ckptops captures, still needs the line."""
    from tasks.checkpoint.facts import checkpoint_facts
    from tasks.resume.checks import Validator

    root, save = failed_run
    before = load_steps(root / "before.jsonl")
    text = (root / "good.log").read_text()
    assert "successfully loaded checkpoint" in text and "at iteration 12" in text
    last_rank = tmp_path / "1.log"
    last_rank.write_text("".join(line for line in text.splitlines(True) if "successfully loaded" not in line))
    result = validate_resume(save / "iter_0000012", before, load_steps(last_rank), SETTINGS)
    assert result.ok, result.line()
    checks = {c.name: c for c in result.checks}
    point = checks["resume point"]
    assert point.observed == "iteration 13 after 96 samples" and "no load line" in point.detail
    # The first line of a run from the checkpoint averages its first iteration alone: compared.
    assert checks["loss and grad norm"].observed.startswith("as expected (1 losses and 2 grad norms compared")

    # The last rank's file with its first iteration's consumed samples 8 more than Megatron printed.
    shifted = tmp_path / "shifted.log"
    shifted.write_text(re.sub(r"(consumed samples: +)104 ", r"\g<1>112 ", last_rank.read_text(), count=1))
    result = validate_resume(save / "iter_0000012", before, load_steps(shifted), SETTINGS)
    point = next(c for c in result.checks if c.name == "resume point")
    assert not result.ok and result.failures[0] is point
    assert (point.expected, point.observed) == (
        "iteration 13 after 96 samples",
        "iteration 13 after 104 samples",
    )

    other = tmp_path / "other.log"
    other.write_text(text.replace("at iteration 12", "at iteration 8"))
    result = validate_resume(save / "iter_0000012", before, load_steps(other), SETTINGS)
    point = next(c for c in result.checks if c.name == "resume point")
    assert not result.ok and point.observed == "iteration 8"
    assert "successfully loaded checkpoint ... at iteration 12" in point.expected

    facts = checkpoint_facts(save / "iter_0000012")
    drill = Validator(facts, before, load_steps(last_rank), SETTINGS, None).continuation()
    point = next(c for c in drill.checks if c.name == "resume point")
    assert not drill.ok and point.observed == "no such line before its steps"


@pytest.fixture(scope="module")
def indexed_run(tmp_path_factory):
    """The failed run on a real indexed dataset (megatron-core's IndexedDatasetBuilder, read by
    GPTDataset with a data cache), resumed from its promoted checkpoint."""
    root = tmp_path_factory.mktemp("indexed")
    data = ("--data-path", str(build_dataset(root / "data" / "tokens")), "--split", "100,0,0")
    data += ("--data-cache-path", str(root / "cache"))
    root, save = killed_between_saves(root, data)
    cached = {p.name: p.stat().st_mtime_ns for p in (root / "cache").iterdir()}
    after = resume((root, save), "indexed", extra=data)
    return root, save, data, cached, after


def test_a_resume_on_a_real_indexed_dataset_continues_exactly(indexed_run):
    root, save, _, cached, after = indexed_run
    # GPTDataset's own index files, written by the first run and read back by the resumed one.
    kinds = {name.rsplit("-", 1)[1] for name in cached}
    assert {"document_index.npy", "sample_index.npy", "shuffle_index.npy"} <= kinds
    assert {p.name: p.stat().st_mtime_ns for p in (root / "cache").iterdir()} == cached
    assert "Build and save the GPTDataset train indices" not in (root / "indexed.log").read_text()
    result = validate_resume(
        save / "iter_0000012", load_steps(root / "before.jsonl"), load_steps(after), SETTINGS
    )
    assert result.ok, result.line()
    from_logs = validate_resume(
        save / "iter_0000012",
        load_steps(root / "checkpoints-train.log"),
        load_steps(root / "indexed.log"),
        SETTINGS,
    )
    assert from_logs.ok, from_logs.line()


def test_a_dataset_rebuilt_under_the_same_path_is_caught_by_data_order(indexed_run):
    root, save, data, _, _ = indexed_run
    other = build_dataset(root / "other" / "tokens", seed=99)
    changed = tuple(str(other) if value == data[1] else value for value in data)
    changed = tuple(str(root / "other-cache") if value == data[-1] else value for value in changed)
    after = resume((root, save), "rebuilt", extra=changed)
    result = validate_resume(
        save / "iter_0000012", load_steps(root / "before.jsonl"), load_steps(after), SETTINGS
    )
    assert failed_checks(result)[0] == "data order", result.line()


def test_a_relaunch_that_found_no_checkpoint_exits_0_and_is_not_a_resume(tmp_path):
    """Megatron-LM 0.19's --exit-on-missing-checkpoint exits 0 when --load holds nothing: the
    exit code says success, and only the log shows that nothing was loaded or trained."""
    empty = tmp_path / "empty"
    empty.mkdir()
    log = run_local_job(  # raises on a non-zero exit
        tmp_path / "save",
        train_iters=24,
        save_interval=1000,
        timeout_seconds=300,
        log=tmp_path / "missing.log",
        extra=["--load", str(empty), "--exit-on-missing-checkpoint"],
    )
    text = log.read_text()
    assert "'--exit-on-missing-checkpoint' set ... exiting." in text
    assert "successfully loaded checkpoint" not in text
    # Nothing in it counts as progress: the recovery's wait for resumed steps sees none.
    with pytest.raises(UsageError, match="missing.log: neither step records nor Megatron-LM log lines"):
        load_steps(log)
