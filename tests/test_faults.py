"""The local job's fault switch (--fail-at RANK:ITERATION:KIND, inside Megatron-LM's loop) fails
a rank the way it says, and triage names the class and the rank's node from the job's own output
(the ranks' lines and torchrun's ChildFailedError summary)."""

import socket
from pathlib import Path

import pytest

from infra.local_job.launch import run_local_job
from tasks.cluster.process import Failed
from tasks.job.step_records import load_steps
from tasks.recovery.triage import attribute_hang, triage

# kind -> (class, text of the first error)
EXPECTED = {
    "ecc": ("hardware", "[rank1]: RuntimeError: CUDA error: uncorrectable ECC error encountered"),
    "oom": ("oom", "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    "nan": ("numerics", "Unexpected result nan"),
    # The hung rank never errs: the others' collective times out (gloo's words on CPU).
    "hang": ("hang", "Timed out waiting"),
    # A rank killed outright says nothing; torchrun's ChildFailedError summary names it and its host.
    "kill": ("hang", "Root Cause (first observed failure): rank 1 (local_rank: 1) on "),
}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_each_fault_fails_the_job_and_triage_names_it(kind, tmp_path, monkeypatch):
    extra = ["--fail-at", f"1:3:{kind}", "--distributed-timeout-seconds", "15"]
    # Flight Recorder on, as a team turns it on: each rank dumps where the prefix says.
    (tmp_path / "fr").mkdir()
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "fr" / "fr_trace_rank_"))
    with pytest.raises(Failed) as failed:
        run_local_job(tmp_path / "ckpt", train_iters=6, save_interval=100, timeout_seconds=300, extra=extra)
    found = triage([Path(failed.value.log)])
    cls, text = EXPECTED[kind]
    assert found.cls == cls, found.line()
    assert text in found.first_error.text, found.line()
    assert found.iteration == 2  # the last iteration finished before the fault
    if kind == "nan":
        # Megatron names the rank's node and the iteration that failed.
        assert found.suspect_nodes and found.anomaly_iteration == 3
    if kind == "kill":
        assert "(SIGKILL)" in found.first_error.text
        assert found.suspect_nodes == [found.first_error.text.split(" on ", 1)[1].split(",")[0].split(".")[0]]
    if kind == "hang":
        # The logs name nobody; the ranks' dumps name the one that never entered the gradients'
        # all-reduce, in Megatron's own data-parallel group.
        assert found.suspect_nodes == []
        found = attribute_hang(found, tmp_path / "fr", {0: "node-a", 1: "node-b"})
        assert found.suspect_ranks == [1] and found.suspect_nodes == ["node-b"]
        stuck = found.stuck_collective
        assert stuck["missing"] == [1] and stuck["present"] == [0] and "DATA_PARALLEL" in stuck["desc"]
    if kind == "kill":
        # Killed outright, rank 1 left no dump; rank 0's shows no collective it is behind in.
        found = attribute_hang(found, tmp_path / "fr", world_size=2)
        assert found.flight_recorder["no_dump"] == [1] and found.suspect_ranks == [1]


@pytest.mark.parametrize(
    "kind, verdict",
    [("nan", ("numerics", 16, "exclude-node-and-rerun")), ("nan-once", ("hardware", 17, "stop"))],
)
def test_the_rerun_state_machines_verdict_is_read_from_its_log_and_tracker(kind, verdict, tmp_path):
    """With --rerun-mode validate_results Megatron reruns the iteration whose gradients were NaN on
    the same GPU. Reproduced (NaN weights): every rank exits 16, rerun on another GPU. Not
    reproduced (one NaN output, a clean rerun): a transient fault of that GPU, exit 17; triage
    calls it hardware on that node, from the log or the result-rejected tracker file alike.
    torchrun itself exits 1: the 16 or 17 is only in its summary."""
    tracker = tmp_path / "rejected.txt"
    extra = [
        "--fail-at",
        f"1:3:{kind}",
        "--rerun-mode",
        "validate_results",
        "--result-rejected-tracker-filename",
        str(tracker),
        "--distributed-timeout-seconds",
        "15",
    ]
    with pytest.raises(Failed) as failed:
        run_local_job(tmp_path / "ckpt", train_iters=6, save_interval=100, timeout_seconds=300, extra=extra)
    assert failed.value.code == 1
    found = triage([Path(failed.value.log)])
    assert (found.cls, found.exit_code, found.megatron) == verdict
    # The node is the one Megatron names for the rank that saw the NaN (its hostname).
    assert found.suspect_nodes == [socket.gethostname()]
    status = "FIRST_RERUN_REPRODUCIBLE" if kind == "nan" else "FIRST_RERUN_NOT_REPRODUCIBLE"
    assert f"status=RerunValidationStatus.{status}" in tracker.read_text()
    from_tracker = triage([tracker])
    assert from_tracker.cls == verdict[0] and from_tracker.suspect_nodes == [socket.gethostname()]


def test_megatron_lms_exit_interval_saves_and_exits_0(tmp_path):
    log = run_local_job(
        tmp_path / "ckpt",
        train_iters=24,
        save_interval=100,
        timeout_seconds=300,
        extra=["--exit-interval", "6"],
    )
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert load_steps(log).iteration[-1] == 6
