"""Readers of ckptops's own records survive bytes ckptops did not write: a line that does not
decode, parse or hold an entry is skipped with one warning naming the file and the line, and
never stops a promotion, a drill's history or a health sweep. A file the job wrote that is not
what it should be (``common.pt``) is one line naming it."""

import json
import logging
import os

import pytest

from tasks.checkpoint.facts import checkpoint_facts
from tasks.checkpoint.layout import HISTORY
from tasks.checkpoint.pins import all_pins, pin
from tasks.checkpoint.pointer import PROMOTIONS, pointer_during, read_pointer, record_promotion
from tasks.errors import CkptopsError, Unreadable
from tasks.health.history import HISTORY as NODE_HISTORY
from tasks.health.history import read_history, record_suspect
from tasks.recovery.ledger import Incident, read_ledger, record
from tasks.restore.history import append_drill, drilled_layouts, read_drills
from tasks.storage.local import TAIL_BYTES, append_jsonl, last_jsonl, read_jsonl
from tests.conftest import iter_dir
from tests.test_cli import ckptops

TORN = b"\xff\xfe torn\n"
WARNING = "skipped: not a record ckptops wrote"


def _spoil(path, *lines: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(b"".join(lines))


def warned(path, lines: str) -> str:
    return f"{path}: {lines} {WARNING} (bad UTF-8, not JSON, or not an entry of this log); the rest is used"


def _warnings(text: str) -> list[str]:
    """The CLI's warnings about skipped lines, without the mark every warning of ours carries."""
    return [line.removeprefix("ckptops: warning: ") for line in text.splitlines() if WARNING in line]


def test_read_jsonl_skips_what_it_cannot_use_with_one_warning_naming_the_file_and_lines(tmp_path, caplog):
    log = tmp_path / "log.jsonl"
    append_jsonl(log, {"n": 1})
    _spoil(log, TORN, b"[1, 2]\n", b'"a string"\n', b"{not json\n", b"\n")
    append_jsonl(log, {"n": 2})
    _spoil(log, b'{"n": 3, "torn": tr')  # a crash mid-append: the last line is torn
    with caplog.at_level(logging.WARNING):
        assert read_jsonl(log) == [{"n": 1}, {"n": 2}]
        assert read_jsonl(log) == [{"n": 1}, {"n": 2}]  # read again: no second warning
        assert read_jsonl(log, lambda e: e["n"] > 1) == [{"n": 2}]
    assert [r.getMessage() for r in caplog.records] == [
        warned(log, "lines 2, 3, 4, 5, 8"),
        warned(log, "lines 1, 2, 3, 4, 5, 8"),
    ]
    assert read_jsonl(tmp_path / "none.jsonl") == []
    os.mkfifo(tmp_path / "fifo.jsonl")  # never blocks the reader
    with pytest.raises(Unreadable, match="fifo.jsonl: a FIFO, not a regular file"):
        read_jsonl(tmp_path / "fifo.jsonl")


def test_last_jsonl_reads_the_end_and_falls_back_to_the_whole_log_on_what_it_cannot_use(tmp_path, caplog):
    """The newest entry (what a promotion asks of its log) from the file's end: what read_jsonl's
    last would be, with its warning where the end holds a line ckptops did not write."""
    log = tmp_path / "log.jsonl"
    assert last_jsonl(log) is None
    _spoil(log, TORN)  # early garbage, then more than the tail of good lines
    for n in range(3 * TAIL_BYTES // 40):
        append_jsonl(log, {"n": n, "pad": "x" * 20})
    last = {"n": 3 * TAIL_BYTES // 40 - 1, "pad": "x" * 20}
    with caplog.at_level(logging.WARNING):
        assert last_jsonl(log) == last
        assert caplog.records == []  # the torn first line was never read
        _spoil(log, b'{"n": -1, "torn": tr')  # a crash mid-append
        assert last_jsonl(log) == last
    assert [r.getMessage() for r in caplog.records] == [warned(log, f"lines 1, {last['n'] + 3}")]
    long = tmp_path / "long.jsonl"
    append_jsonl(long, {"n": 1})
    append_jsonl(long, {"n": "not this log's"})
    assert last_jsonl(long, lambda e: isinstance(e["n"], int)) == {"n": 1}
    append_jsonl(long, {"n": 2, "pad": "y" * 2 * TAIL_BYTES})  # one line longer than the tail
    assert last_jsonl(long) == {"n": 2, "pad": "y" * 2 * TAIL_BYTES}
    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(Unreadable, match="fifo.jsonl: a FIFO, not a regular file"):
        last_jsonl(tmp_path / "fifo.jsonl")


def test_a_torn_byte_in_the_promotion_log_does_not_stop_promote(save_dir):
    """Before: ``ckptops promote`` exited 1 with a UnicodeDecodeError traceback."""
    log = save_dir / HISTORY / PROMOTIONS
    _spoil(log, TORN)
    result = ckptops("promote", save_dir)
    assert result.returncode == 0, result.stderr
    assert read_pointer(save_dir) == 24 and "Traceback" not in result.stderr
    assert _warnings(result.stderr) == [warned(log, "line 1")]
    # The promotion it made is logged after the torn line, and read back.
    assert pointer_during(save_dir, 0, float("inf")) == {None, 24}


def test_the_promotion_log_keeps_only_changes_of_the_pointer(tmp_path):
    record_promotion(tmp_path, 8, None, "promoted")
    _spoil(
        tmp_path / HISTORY / PROMOTIONS,
        b'{"time": "soon", "iteration": 9}\n',
        b'{"time": 1, "iteration": "x"}\n',
    )
    record_promotion(tmp_path, 12, 8, "promoted")
    assert pointer_during(tmp_path, 0, float("inf")) == {None, 8, 12}


def test_a_torn_byte_in_a_nodes_history_does_not_stop_the_sweep(tmp_path):
    """Before: the UnicodeDecodeError ended the whole sweep (no verdicts, no drains). Now the
    node's good lines still count: its two recorded suspicions make it a repeat suspect."""
    raw = tmp_path / "raw"
    assert record_suspect(raw, "a", "inc-1")
    _spoil(raw / "a" / NODE_HISTORY, TORN, b'{"kind": ["not", "a", "kind"]}\n')
    assert record_suspect(raw, "a", "inc-2")
    # Node b's folder planted as a link: b cannot be recorded, and the sweep goes on.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (raw / "b").symlink_to(elsewhere)
    profile = tmp_path / "health.yaml"
    profile.write_text(
        f"job: {{name: t, save_dir: '{tmp_path}'}}\n"
        f"health: {{nodes: [a, b], transport: local, raw_dir: '{raw}', checks: [gpu-count]}}\n"
    )
    result = ckptops("health", "run", "--profile", profile, "--json")
    assert "Traceback" not in result.stderr, result.stderr
    verdicts = {r["node"]: r for r in json.loads(result.stdout)["nodes"]}
    assert set(verdicts) == {"a", "b"}
    checks = {c["name"]: c for c in verdicts["a"]["checks"]}
    assert checks["suspect-history"]["verdict"] == "FAIL_HARDWARE"
    assert _warnings(result.stderr) == [warned(raw / "a" / NODE_HISTORY, "lines 2, 3")]
    assert f"ckptops: warning: {raw / 'a' / NODE_HISTORY}: lines 2, 3" in result.stderr
    # Its checks could keep no raw output (SUSPECT), its verdict no line: nothing went elsewhere.
    assert verdicts["b"]["verdict"] == "SUSPECT" and list(elsewhere.iterdir()) == []
    recorded = {c["name"]: c for c in verdicts["b"]["checks"]}["suspect-history"]
    assert recorded["verdict"] == "TOOL_ERROR"
    assert recorded["detail"].startswith(f"verdict not recorded: {raw / 'b'}: a symbolic link where ckptops")
    # The verdicts were recorded after the torn line, and read back.
    assert [e["kind"] for e in read_history(raw, "a")] == ["suspect", "suspect", "verdict"]


def test_drill_history_keeps_only_drill_records(tmp_path):
    from tasks.restore.history import trend_rows

    class Report:
        def __init__(self, **fields):
            self.fields = fields

        def to_dict(self):
            return {
                "source": "shared",
                "started_at": "2026-12-01T03:00:00+00:00",
                "ok": True,
                "window_seconds": 1.5,
                "budget_seconds": 60,
                "id": "d1",
                "phases": [{"name": "copy", "seconds": 1.0, "bytes": 100}],
                "checks": [{"name": "model", "outcome": "pass"}],
                "layout": {"tensor_parallel": 1, "pipeline_parallel": 1},
            } | self.fields

    append_drill(tmp_path, Report())
    _spoil(
        tmp_path / HISTORY / "drills.jsonl",
        TORN,
        b'{"source": "shared"}\n',  # no window, no start
        b'{"source": "shared", "started_at": "x", "ok": true, "window_seconds": 1, "budget_seconds": 1,'
        b' "layout": {"tensor_parallel": "two", "pipeline_parallel": 1}}\n',
    )
    append_drill(tmp_path, Report(id="d2", layout={"tensor_parallel": 2, "pipeline_parallel": 1}))
    drills = read_drills(tmp_path)
    assert [d["id"] for d in drills] == ["d1", "d2"]
    assert len(trend_rows(drills)) == 2
    assert drilled_layouts(tmp_path) == {(1, 1): "d1", (2, 1): "d2"}


def test_the_ledger_and_pins_survive_bytes_they_did_not_write(tmp_path):
    incident = Incident("inc-1", "j", "cli", outcome="running")
    record(tmp_path, incident)
    from tasks.recovery.ledger import ledger_path

    _spoil(ledger_path(tmp_path), TORN)
    read = read_ledger(tmp_path)
    assert [i.id for i in read.incidents] == ["inc-1"]
    assert len(read.problems) == 1 and f"{ledger_path(tmp_path)}:2: not JSON" in read.problems[0]

    # A pin that is not one of ours (bad UTF-8, a FIFO, a lease naming no start time) is kept as
    # an operator's pin: it errs on keeping the checkpoint, and never blocks or stops the reader.
    (tmp_path / "iter_0000004").mkdir()
    pin(tmp_path, 4, "op", "before the LR change")
    folder = tmp_path / ".ckptops-pins"
    (folder / "iter_0000008@torn").write_bytes(TORN)
    os.mkfifo(folder / "iter_0000012@fifo")
    (folder / "iter_0000016@lease").write_text(
        json.dumps({"lease": {"host": os.uname().nodename, "pid": os.getpid(), "started": "x"}})
    )
    found = {p.holder: p for p in all_pins(tmp_path)}
    assert set(found) == {"op", "torn", "fifo", "lease"}
    assert found["torn"].lease is None and found["fifo"].lease is None
    assert (
        found["lease"].expired()
        == f"lease expired: process {os.getpid()}: no start time recorded, so not provably the holder"
    )


def test_a_common_state_without_megatrons_fields_is_one_line_naming_the_checkpoint(save_dir, monkeypatch):
    """The safe loader reads a truncated or non-pickle ``common.pt`` as one line already
    (tasks.checkpoint.dcp); a common state it reads that lacks Megatron-LM's fields (the job's
    own bytes, or bytes put there) is one line too, not a KeyError."""
    from tasks.checkpoint import facts

    directory = iter_dir(save_dir, 24)
    real = facts.load_common_state
    for damage in ({"iteration"}, {"args"}, {"opt_param_scheduler"}):
        monkeypatch.setattr(
            facts,
            "load_common_state",
            lambda *a, damage=damage: {k: v for k, v in real(*a).items() if k not in damage},
        )
        with pytest.raises(CkptopsError, match=f"{directory}: it lacks what Megatron-LM or Megatron-Bridge"):
            checkpoint_facts(directory)
