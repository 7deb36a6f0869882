"""The suite's CPU meter (tests/bench/cpu_by_process.py): the kernel's records read, and a warm
fork counted under the process that stood for it."""

import pytest

from tests.bench import cpu_by_process


def test_the_kernels_records_are_read_with_their_times_in_seconds(tmp_path):
    """struct acct_v3 as linux/acct.h lays it out; times as comp_t in AHZ ticks (1.5 s of user
    time is 150 ticks; 9,000 ticks need the exponent: 1,125 x 8)."""
    record = cpu_by_process.RECORD.pack(
        0, 3, 0, 0, 0, 0, 4242, 1, 1_000_000, 250.0, 150, (1 << 13) | 1125, 0, 0, 0, 0, 0, 0, b"pretrain.py"
    )
    (tmp_path / "acct").write_bytes(record * 2)
    (first, second) = cpu_by_process.records(tmp_path / "acct")
    assert (
        first
        == second
        == {"pid": 4242, "start": 1_000_000, "end": 1_000_002.5, "cpu": 91.5, "comm": "pretrain.py"}
    )


def test_a_warm_fork_counts_under_the_process_that_stood_for_it():
    names = {
        "10": "python -m tests.helpers.warm.server training /tmp/w/training.sock",
        "11": "/venv/bin/python -u /repo/infra/local_job/pretrain.py --save /tmp/x",
        "12": "/venv/bin/python -m tasks.restore.loader --checkpoint /tmp/c",
    }
    found = [
        {"pid": 10, "start": 100, "end": 130.0, "cpu": 2.5, "comm": "python"},
        {"pid": 11, "start": 100, "end": 130.2, "cpu": 0.1, "comm": "python"},
        {"pid": 12, "start": 140, "end": 150.0, "cpu": 0.3, "comm": "python"},
        {"pid": 13, "start": 141, "end": 141.1, "cpu": 0.2, "comm": "bash"},
    ]
    totals = cpu_by_process.by_command(found, names)
    assert totals == {
        "pretrain.py --save": pytest.approx(2.6),
        "tasks.restore.loader --checkpoint": 0.3,
        "[bash]": 0.2,
    }
