"""The step recorder's format and its reader: what a training loop writes is what validation reads."""

import json

import pytest

from ckptops_records import FULL_IDS, StepRecorder, batch_summary
from tasks.errors import UsageError
from tasks.job.step_records import load_steps


def record_steps(path, count=5, ids=range(8), attempt="attempt-1", first=1):
    recorder = StepRecorder(path, "run-1", attempt, flops_per_step=1e12)
    for it in range(first, first + count):
        recorder.record(
            iteration=it,
            consumed_samples=it * 8,
            lr=1e-3 * it,
            batch=batch_summary((it - 1) * 8, ids),
            loss=2.5 - it / 100,
            grad_norm=None if it == 2 else 1.0,
            skipped=int(it == 3),
            nan=0,
            tokens=256,
            step_seconds=0.5,
        )
    recorder.close()


def test_recorded_steps_read_back(tmp_path):
    path = tmp_path / "steps.jsonl"
    record_steps(path)
    first = json.loads(path.read_text().splitlines()[0])
    assert first["run"] == "run-1" and first["attempt"] == "attempt-1" and first["tflops"] == 2.0
    assert first["tokens_per_second"] == 512 and first["memory_kind"] in (
        "cpu_peak_rss",
        "cuda_max_allocated",
    )
    assert first["peak_memory_bytes"] > 0 and first["batch"]["ids"] == list(range(8))
    steps = load_steps(path)
    assert steps.kind == "records" and list(steps.iteration) == [1, 2, 3, 4, 5]
    assert list(steps.consumed) == [8, 16, 24, 32, 40] and steps.lr[2] == pytest.approx(3e-3)
    assert list(steps.skipped) == [0, 0, 1, 0, 0] and steps.grad_norm[1] != steps.grad_norm[1]  # None -> NaN
    assert (
        list(steps.batch_position) == [0, 8, 16, 24, 32] and steps.batch_digest[0] == first["batch"]["digest"]
    )


def test_large_batches_are_kept_as_a_digest():
    small, large = batch_summary(0, range(FULL_IDS)), batch_summary(0, range(FULL_IDS + 1))
    assert "ids" in small and "ids" not in large
    assert large["count"] == FULL_IDS + 1 and (large["first"], large["last"]) == (0, FULL_IDS)
    assert batch_summary(0, range(1, FULL_IDS + 2))["digest"] != large["digest"]


def test_a_torn_last_line_is_forgiven_a_bad_line_is_not(tmp_path):
    path = tmp_path / "steps.jsonl"
    record_steps(path)
    path.write_text(path.read_text() + '{"v": 1, "iteration": 6, "consumed_sam')
    assert len(load_steps(path)) == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"iteration": 1}\nnot json\n{"iteration": 3}\n')
    with pytest.raises(UsageError, match="bad.jsonl: not step records"):
        load_steps(bad)
    nameless = tmp_path / "nameless.jsonl"
    nameless.write_text('{"iteration": 1}\n{"loss": 2.0}\n')
    with pytest.raises(UsageError, match="record 2 has no iteration"):
        load_steps(nameless)
    with pytest.raises(UsageError, match="neither step records nor Megatron-LM log lines"):
        (tmp_path / "other.txt").write_text("hello\n")
        load_steps(tmp_path / "other.txt")


def test_the_last_attempt_starts_where_the_attempt_id_changes(tmp_path):
    """An attempt that died exactly at a checkpoint leaves no drop in the iteration numbers."""
    from tasks.relaunch.continuity import last_attempt

    path = tmp_path / "steps.jsonl"
    record_steps(path, count=12)
    record_steps(path, count=18, attempt="attempt-2", first=13)
    steps = load_steps(path)
    assert steps.iteration[last_attempt(steps)] == 13
    path.write_text(
        path.read_text() + path.read_text().split("\n", 12)[-1]
    )  # the same attempt appended again
    assert last_attempt(load_steps(path)) == 30


def test_a_wsd_schedule_is_replayed_from_the_checkpoint_args(tmp_path):
    """Megatron's scheduler state leaves out the WSD decay settings; the args have them."""
    from types import SimpleNamespace

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from tasks.checkpoint.facts import CheckpointFacts, wsd_decay_steps
    from tasks.relaunch.continuity import schedule

    args = SimpleNamespace(
        train_iters=100, global_batch_size=8, lr_wsd_decay_iters=20, lr_wsd_decay_style="linear"
    )
    settings = dict(
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-5,
        lr_warmup_steps=80,
        lr_decay_steps=800,
        lr_decay_style="WSD",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=800,
        wd_incr_style="constant",
    )
    job = OptimizerParamScheduler(
        SimpleNamespace(param_groups=[{}]),
        **settings,
        wsd_decay_steps=wsd_decay_steps(args),
        lr_wsd_decay_style="linear",
    )
    state = job.state_dict()
    assert "wsd_decay_steps" not in state
    facts = CheckpointFacts(
        tmp_path, 50, 400, 8, state, 0.0, True, wsd_decay_steps(args), args.lr_wsd_decay_style
    )
    lr_after = schedule(facts)
    for consumed in (40, 400, 700, 760, 800):
        job.num_steps = consumed
        assert lr_after(consumed) == job.get_lr({})


def test_an_iteration_line_rank_0s_memory_report_landed_on_is_still_read(tmp_path):
    """Rank 0's memory report and the last rank's iteration lines share one output: under load
    the report is written onto the end of an iteration line (two lines of a real Megatron-LM
    pretrain() log of the local job, as they were printed). Both are read."""
    log = tmp_path / "resumed.log"
    log.write_text(
        "[2026-12-06 02:17:17.190034] iteration       13/      24 | consumed samples:          104 | "
        "elapsed time per iteration (ms): 172.3 | learning rate: 9.920673E-04 | global batch size:     8 | "
        "lm loss: 4.001231E+00 | loss scale: 1.0 | grad norm: 1.389 | number of skipped iterations:   0 | "
        "number of nan iterations:   0 |[Rank 0] (after 13 iterations) memory (MB) | allocated: 0.00 | "
        "max allocated: 0.00 | reserved: 0.00 | max reserved: 0.00\n"
        "[2026-12-06 02:17:17.237115] iteration       14/      24 | consumed samples:          112 | "
        "elapsed time per iteration (ms): 109.6 | learning rate: 9.913462E-04 | global batch size:     8 | "
        "lm loss: 3.955131E+00 | loss scale: 1.0 | grad norm: 1.372 | number of skipped iterations:   0 | "
        "number of nan iterations:   0 |\n"
    )
    steps = load_steps(log)
    assert steps.iteration.tolist() == [13, 14] and steps.columns["consumed"].tolist() == [104, 112]
    assert steps.columns["grad_norm"].tolist() == [1.389, 1.372]
    assert steps.columns["peak_memory"][0] == 0  # the report, for the iteration it followed
