"""Flight Recorder dumps ckptops did not write, read under tasks/storage/bounded.py's policy: a
dump nested too deep, a time or a rank no job has, a pickle that would unpickle to gigabytes, one
rank's claim of a world of millions, a stray file of a rank no job has. Each is dropped with one
line naming the file and the limit, and the rest still name the culprits. The dumps are NVRx's
real ones (tests/data/flight_recorder/SOURCES.md), copied before anything is changed; the bombs
are made here."""

import json
import pickle
import shutil
from pathlib import Path

import pytest

from tasks.recovery.triage import flight_recorder as fr
from tasks.recovery.triage.flight_recorder import flight_recorder
from tests.test_cli import ckptops_here
from tests.triage_accuracy import hang_cases

CASE, MISSING, _ = hang_cases()[0]  # gpu_error_1st: rank 12 never entered, 16 ranks


@pytest.fixture
def dumps(tmp_path) -> Path:
    return Path(shutil.copytree(CASE, tmp_path / "fr"))


def _data(folder: Path, rank: int) -> dict:
    return pickle.loads((folder / f"_dump_{rank}").read_bytes())  # the project's own test data


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _still_names_the_culprit(seen, problems: int) -> None:
    assert tuple(seen.suspect_ranks) == MISSING and seen.expected == 16 and seen.no_dump == []
    assert len(seen.problems) == problems, seen.problems


def test_a_deep_json_dump_and_a_deep_ranks_string_are_one_line_each(dumps):
    (dumps / "_dump_3").write_text('{"version": "2.10", "entries": ' + _nested(100_000) + "}")
    data = _data(dumps, 5)
    data["pg_config"]["0"]["ranks"] = _nested(100_000)
    (dumps / "_dump_5").write_bytes(pickle.dumps(data))
    seen = flight_recorder(dumps)
    assert sorted(seen.problems) == [
        f"{dumps / '_dump_3'}: Flight Recorder dump nests deeper than 16 levels; refused",
        f"{dumps / '_dump_5'}: process group '0''s ranks nests deeper than 1 levels; refused",
    ]
    assert tuple(seen.suspect_ranks) == MISSING and seen.read == 14


def test_a_pickle_nested_deeper_than_a_dump_is_refused(dumps):
    nested: list = []
    for _ in range(100):
        nested = [nested]
    (dumps / "_dump_3").write_bytes(pickle.dumps({"version": "2.10", "entries": nested}))
    seen = flight_recorder(dumps)
    assert seen.problems == [
        f"{dumps / '_dump_3'}: Flight Recorder dump nests deeper than 16 levels; refused"
    ]


@pytest.mark.parametrize(
    "created", [10**30, 10**5000, -1, "soon"], ids=["huge", "past-printing", "negative", "text"]
)
def test_a_time_no_dump_has_drops_that_dump(dumps, created):
    data = _data(dumps, 3)
    data["entries"][0]["time_created_ns"] = created
    (dumps / "_dump_3").write_bytes(pickle.dumps(data))
    seen = flight_recorder(dumps)
    (line,) = seen.problems
    assert line.startswith(f"{dumps / '_dump_3'}: entry 0's time_created_ns is "), line
    assert len(line) < 300 and "refused" in line or "not an integer" in line
    _still_names_the_culprit(seen, 1)


def test_a_memo_reference_bomb_is_refused_before_it_is_unpickled(dumps, monkeypatch):
    """A list referred to again and again (two bytes a reference): 10 MB that unpickles to 40 MB
    of references, as the 115 MB one of the finding to 1.5 GB; the limit is lowered here so the
    test scans less."""
    monkeypatch.setattr(fr, "MAX_DUMP_VALUES", 100_000)
    unpickled, load = [], fr._PlainValues.load
    monkeypatch.setattr(fr._PlainValues, "load", lambda self: unpickled.append(1) or load(self))
    bomb = b"\x80\x02]q\x00(" + b"h\x00" * 5_000_000 + b"e."
    (dumps / "_dump_3").write_bytes(bomb)
    seen = fr.read_dumps(dumps)
    assert seen[1] == [
        f"{dumps / '_dump_3'}: a pickle of over 100,000 values and references, more than a Flight "
        "Recorder dump holds; refused unread"
    ]
    assert unpickled == [1] * 15  # every other dump, never the bomb


def test_the_real_pickle_scan_counts_what_the_unpickler_reads():
    """The scan walks each real dump to its STOP (a wrong width would run past it or stop short)."""
    import pickletools

    for folder, _, _ in hang_cases():
        for dump in folder.glob("_dump_*"):
            raw = dump.read_bytes()
            ops = sum(1 for _ in pickletools.genops(raw))
            fr._scan(raw, dump)  # no refusal
            assert ops < fr.MAX_DUMP_VALUES


def test_a_dump_over_the_size_limit_is_refused_unread(dumps, monkeypatch):
    monkeypatch.setattr(fr, "MAX_DUMP_BYTES", 7_000)
    seen = flight_recorder(dumps)
    (line,) = seen.problems
    assert line.startswith(f"{dumps / '_dump_14'}: a Flight Recorder dump is larger than 7,000 bytes")


def test_one_ranks_claim_of_a_world_of_millions_is_refused_and_the_rest_agree(dumps):
    data = _data(dumps, 3)
    data["pg_config"]["0"]["ranks"] = json.dumps(list(range(3_000_000)))
    (dumps / "_dump_3").write_bytes(pickle.dumps(data))
    data["pg_config"]["0"]["ranks"] = json.dumps(list(range(1000)))
    (dumps / "_dump_4").write_bytes(pickle.dumps(data))
    seen = flight_recorder(dumps)
    assert seen.problems == [
        f"{dumps / '_dump_3'}: process group '0''s ranks is longer than 12,582,912 characters; refused",
        f"{dumps / '_dump_4'}: another job's dump (a world of 1000 ranks, not 16)",
    ]
    _still_names_the_culprit(seen, 2)
    # The CLI's answer is as short as the job: no list of a million ranks that left no dump.
    result = ckptops_here("triage", "--flight-recorder", dumps, "--json")
    answer = json.loads(result.stdout)
    assert answer["suspect_ranks"] == list(MISSING) and answer["flight_recorder"]["expected"] == 16
    assert len(result.stdout) < 20_000


def test_a_stray_file_of_a_rank_no_job_has_is_never_a_suspect(dumps):
    culprit = (dumps / f"_dump_{MISSING[0]}").read_bytes()
    (dumps / f"_dump_{'9' * 40}").write_bytes(culprit)
    (dumps / "_dump_16").write_bytes(culprit)
    seen = flight_recorder(dumps)
    assert sorted(seen.problems) == [
        f"{dumps / '_dump_16'}: rank 16 is outside the dump's own world of 16 ranks; refused",
        f"{dumps / f'_dump_{"9" * 40}'}: rank 99999999...9999 (40 digits) is outside 0..1,048,575, the "
        "ranks ckptops reads; not a dump of this job",
    ]
    _still_names_the_culprit(seen, 2)
    # A job's own world given: a file beyond it is not read at all.
    seen = flight_recorder(dumps, world_size=16)
    assert tuple(seen.suspect_ranks) == MISSING and seen.files == set(range(16))


def test_gloo_dumps_without_a_world_ignore_one_ranks_claim(tmp_path):
    """gloo's dumps state no world: one dump that claims one is no majority."""
    folder = Path(shutil.copytree(CASE, tmp_path / "fr"))
    for dump in folder.glob("_dump_*"):
        data = pickle.loads(dump.read_bytes())
        data["pg_config"] = {}
        dump.write_bytes(pickle.dumps(data))
    data = _data(CASE, 3)
    data["pg_config"]["0"]["ranks"] = json.dumps(list(range(1000)))
    (folder / "_dump_3").write_bytes(pickle.dumps(data))
    seen = flight_recorder(folder)
    assert seen.expected is None and seen.no_dump == []
    assert seen.problems == ["the dumps agree on no world size (1,000 ranks in 1 of 16 dumps)"]


def test_the_dumps_alone_name_exactly_the_held_out_cases_faulty_ranks():
    """``ckptops triage --flight-recorder DIR --json``, no logs: each of NVRx's recorded cases
    names exactly its reference's missing ranks."""
    for folder, missing, injected in hang_cases():
        result = ckptops_here("triage", "--flight-recorder", folder, "--json")
        assert result.exit_code == 0, result.output
        answer = json.loads(result.stdout)
        assert answer["class"] == "hang" and tuple(answer["suspect_ranks"]) == missing, folder
        assert set(missing) <= set(injected)


def test_a_slurm_task_layout_smaller_than_the_dumps_world_drops_no_dump(dumps):
    """torchrun under Slurm: one Slurm task a node, many ranks a task. The scheduler's layout (2
    tasks here) is no world size: the 16 ranks' dumps are all read, and their suspects are not
    mapped to the nodes of the tasks that happen to share their numbers."""
    from tasks.recovery.triage import attribute_hang
    from tasks.recovery.triage.model import Triage

    tasks = {0: "node-a", 1: "node-b"}
    found = attribute_hang(Triage("unknown", [], None, [], "nothing recognised"), dumps, tasks)
    assert found.cls == "hang" and tuple(found.suspect_ranks) == MISSING
    assert found.flight_recorder["read"] == 16 and found.flight_recorder["expected"] == 16
    assert found.flight_recorder["problems"] == [] and found.suspect_nodes == []
    assert "the job's 2 tasks are not its ranks" in found.reason
    # A layout of exactly the dumps' ranks still names the suspects' nodes.
    ranks = {r: f"node-{r // 8}" for r in range(16)}
    found = attribute_hang(Triage("hang", [], None, [], "timeouts"), dumps, ranks)
    assert found.suspect_nodes == ["node-1"] and tuple(found.suspect_ranks) == MISSING
    # Only an explicit world size drops the dumps of another.
    assert fr.read_dumps(dumps, world_size=2)[0] == []


def test_dumps_older_than_the_failed_jobs_start_are_an_earlier_runs_and_ignored(dumps):
    """A dump written before the job started (its file's time), or whose newest entry is older,
    is left out with one line for all of them; an unknown failure whose only dumps are old stays
    unknown, and the ranks of old files are no ranks that dumped."""
    import os

    from tasks.recovery.triage import attribute_hang
    from tasks.recovery.triage.model import Triage

    entries = min(d.newest_ns for d in fr.read_dumps(dumps)[0]) / 1e9  # NVRx's run, 2025
    started = entries - 60
    for rank in (0, 1, 2):
        os.utime(dumps / f"_dump_{rank}", (started - 3600, started - 3600))
    read, problems, files, world = fr.read_dumps(dumps, since=started)
    assert sorted(d.rank for d in read) == list(range(3, 16)) and files == set(range(3, 16))
    (line,) = problems
    assert (
        line.startswith(f"{dumps}: 3 dumps older than the failed job's start (")
        and "(first: _dump_0)" in line
    )
    # Started after every entry (the files are new): every dump is an earlier run's.
    for dump in dumps.glob("_dump_*"):
        os.utime(dump)
    read, problems, files, _ = fr.read_dumps(dumps, since=entries + 3600 * 24)
    assert read == [] and files == set() and len(problems) == 1 and "16 dumps older" in problems[0]
    found = Triage("unknown", [], None, [], "nothing recognised")
    found = attribute_hang(found, dumps, required=False, since=entries + 3600 * 24)
    assert found.cls == "unknown" and found.suspect_ranks == []
    assert found.flight_recorder["problems"] == problems
    # Without a start, or with the real one, the same dumps make it a hang.
    found = attribute_hang(Triage("unknown", [], None, [], "x"), dumps, since=started)
    assert found.cls == "hang" and tuple(found.suspect_ranks) == MISSING
