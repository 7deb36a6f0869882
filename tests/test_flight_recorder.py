"""A hang's culprit from PyTorch's Flight Recorder: real dumps of a four-rank gloo job with
Megatron's kind of process groups (tests/helpers/hang_job.py), where rank 3 stops before a
collective; its two peers wait for it, and a third rank waits on one of them (a victim). Bad dumps
(torn, a pickle that names a Python object, an unknown version, another job's) are one line each
and never stop the reading of the rest. The local job's own hang writes real dumps too
(tests/test_faults.py)."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.recovery.triage import attribute_hang, triage
from tasks.recovery.triage.flight_recorder import _pending, flight_recorder, read_dumps
from tasks.storage.local import TEMP_MARK
from tests.conftest import ROOT
from tests.test_cli import ckptops_here

PREFIX = "nccl_trace_rank_"  # NCCL's default naming, which torch's own reader expects


@pytest.fixture(scope="module")
def hang(tmp_path_factory) -> tuple[Path, Path]:
    """(the folder of the four ranks' dumps, the job's output)."""
    root = tmp_path_factory.mktemp("hang")
    dumps = root / "fr"
    dumps.mkdir()
    env = {
        **os.environ,
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": str(dumps / PREFIX),
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]
    done = subprocess.run(
        argv + ["tests/helpers/hang_job.py", "--hang", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0, done.stdout[-2000:]
    log = root / "job.log"
    log.write_text(done.stdout + done.stderr)
    return dumps, log


def test_the_rank_that_never_entered_is_named_and_the_ranks_waiting_on_others_are_not(hang):
    dumps, _ = hang
    seen = flight_recorder(dumps, world_size=4)
    assert seen.suspect_ranks == [3] and seen.read == 4 and seen.no_dump == [] and seen.problems == []
    stuck = seen.stuck
    assert stuck["missing"] == [3] and stuck["size"] == 2 and stuck["op"] == "gloo:all_reduce"
    assert stuck["desc"] in ("TENSOR_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP")
    assert stuck["present"] == ([2] if stuck["desc"] == "TENSOR_MODEL_PARALLEL_GROUP" else [1])
    # Rank 2 never entered its data-parallel collective either, but it waits in another: a victim.
    pending = _pending({d.rank: d for d in read_dumps(dumps)[0]})
    assert {(p["desc"], tuple(p["missing"])) for p in pending} == {
        ("TENSOR_MODEL_PARALLEL_GROUP", (3,)),
        ("DATA_PARALLEL_GROUP", (3,)),
        ("DATA_PARALLEL_GROUP", (2,)),
    }
    assert "never did; dumps of 4 of 4 ranks read" in seen.reason


def test_triage_of_the_jobs_own_output_adds_the_ranks_and_their_nodes(hang):
    dumps, log = hang
    found = triage([log])
    assert found.cls == "hang" and found.suspect_ranks == []  # the logs alone name nobody
    layout = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
    found = attribute_hang(found, dumps, layout)
    assert found.suspect_ranks == [3] and found.suspect_nodes == ["node-b"]
    assert found.to_dict()["stuck_collective"]["missing"] == [3]
    assert "Flight Recorder: gloo:all_reduce #" in found.reason and "dumps of 4 of 4" in found.reason
    # The CLI: the JSON keys, and the one line.
    result = ckptops_here("triage", log, "--flight-recorder", dumps, "--world-size", "4", "--json")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["class"] == "hang" and answer["suspect_ranks"] == [3]
    assert answer["stuck_collective"]["missing"] == [3] and answer["flight_recorder"]["read"] == 4
    line = ckptops_here("triage", log, "--flight-recorder", dumps).stdout.splitlines()[0]
    assert line.startswith("hang") and "never did; dumps of 4 ranks read" in line


def test_bad_dumps_are_one_line_each_and_the_rest_is_still_read(hang, tmp_path):
    dumps, _ = hang
    bad = Path(shutil.copytree(dumps, tmp_path / "fr"))
    torn = bad / f"{PREFIX}1"
    torn.write_bytes(torn.read_bytes()[:300])
    marker = tmp_path / "executed"
    (bad / f"{PREFIX}2").write_bytes(pickle.dumps(_Payload(str(marker))))
    data = pickle.loads((bad / f"{PREFIX}0").read_bytes())
    (bad / f"{PREFIX}0").write_bytes(pickle.dumps({**data, "version": "9.1"}))
    shutil.copy(dumps / f"{PREFIX}3", bad / "other_job_trace_3")
    # A dump still being written (atomic_write's temporary, whose random tail may end in a digit)
    # is no dump yet, nor another job's.
    (bad / f"{PREFIX}1{TEMP_MARK}4242-x7").write_bytes(b"\x80")
    seen = flight_recorder(bad, world_size=4)
    assert not marker.exists()  # the pickle's payload never ran
    assert sorted(seen.problems) == sorted(
        [
            f"{bad / f'{PREFIX}0'}: Flight Recorder dump version '9.1', not one this reader knows (2.x)",
            f"{torn}: torn or not a Flight Recorder dump (pickle data was truncated)",
            f"{bad / f'{PREFIX}2'}: not a Flight Recorder dump, refused unread: it names the Python "
            "object posix.system",
            f"{bad / 'other_job_trace_3'}: another job's dump (prefix 'other_job_trace_', not '{PREFIX}')",
        ]
    )
    # One usable dump of four: nothing to compare it with, and no rank is blamed for a bad file.
    assert seen.read == 1 and seen.no_dump == [] and seen.suspect_ranks == []
    assert "dumps of 1 of 4 ranks read, 4 unusable" in seen.reason
    # Ranks that left no file at all, while the others agree: those are named.
    for rank in (0, 1, 2):
        (bad / f"{PREFIX}{rank}").unlink()
    shutil.copy(dumps / f"{PREFIX}2", bad / f"{PREFIX}2")
    seen = flight_recorder(bad, world_size=4)
    assert seen.no_dump == [0, 1] and seen.read == 2


def test_no_dumps_is_one_line_and_exit_2(hang, tmp_path):
    _, log = hang
    result = ckptops_here("triage", log, "--flight-recorder", tmp_path / "none")
    assert result.exit_code == 2
    assert (
        result.stderr.strip() == f"ckptops: {tmp_path / 'none'}: no such directory of Flight Recorder dumps"
    )
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README").write_text("x")
    result = ckptops_here("triage", log, "--flight-recorder", tmp_path / "empty")
    assert result.exit_code == 2 and "no Flight Recorder dumps (files named PREFIX<rank>)" in result.stderr


class _Payload:
    """A pickle that would run a command if it were fully unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_recovery_of_a_hang_reads_the_dumps_its_profile_names(hang, tmp_path):
    """recovery.flight_recorder_dir: the incident records what the dumps showed; a profile whose
    folder holds none says so in the incident, and the recovery goes on."""
    from tests.test_recovery import local_profile

    dumps, log = hang
    profile = local_profile(tmp_path, flight_recorder_dir=str(dumps))
    done = ckptops_here("recover", "--logs", log, "--json", "--profile", profile)
    incident = json.loads(done.stdout)
    assert incident["class"] == "hang", done.output
    assert incident["hang"].startswith("gloo:all_reduce #") and "rank 3 never did" in incident["hang"]
    (tmp_path / "again").mkdir()
    profile = local_profile(tmp_path / "again", flight_recorder_dir=str(tmp_path / "none"))
    incident = json.loads(ckptops_here("recover", "--logs", log, "--json", "--profile", profile).stdout)
    assert incident["class"] == "hang"
    assert incident["hang"] == f"{tmp_path / 'none'}: no such directory of Flight Recorder dumps"


def test_triage_of_the_dumps_alone_or_of_a_log_that_says_nothing_of_a_hang(hang, tmp_path):
    """The dumps are evidence of a hang in themselves: no logs at all, or a log with only the
    job's own progress (it was killed in its hang), still name rank 3, without a traceback."""
    dumps, _ = hang
    alone = ckptops_here("triage", "--flight-recorder", dumps, "--json")
    assert alone.exit_code == 0, alone.output
    answer = json.loads(alone.stdout)
    assert (answer["class"], answer["suspect_ranks"]) == ("hang", [3])
    quiet = tmp_path / "job.log"
    quiet.write_text("".join(f"rank {r} step 1\n" for r in range(4)))
    said = ckptops_here("triage", quiet, "--flight-recorder", dumps, "--world-size", "4")
    assert said.exit_code == 0 and said.stdout.startswith("hang"), said.output
    assert "rank 3 never did" in said.stdout and "Traceback" not in said.output
    refused = ckptops_here("triage")
    assert refused.exit_code == 2 and "--flight-recorder DIR" in refused.stderr


def test_a_recovery_whose_dumps_are_bad_still_writes_its_incident(hang, tmp_path):
    """A dump nested past the limit and a stray file of a rank no job has: one warning each, the
    rest of the dumps still name rank 3, and the incident is written."""
    from tests.test_recovery import local_profile

    dumps, log = hang
    bad = Path(shutil.copytree(dumps, tmp_path / "fr"))
    (bad / f"{PREFIX}0").write_text('{"entries": ' + "[" * 50_000 + "]" * 50_000 + "}")
    shutil.copy(dumps / f"{PREFIX}3", bad / f"{PREFIX}{'9' * 30}")
    profile = local_profile(tmp_path, flight_recorder_dir=str(bad))
    done = ckptops_here("recover", "--logs", log, "--json", "--profile", profile)
    incident = json.loads(done.stdout)
    assert incident["class"] == "hang" and "rank 3 never did" in incident["hang"], done.output
    assert f"{bad / f'{PREFIX}0'}: Flight Recorder dump nests deeper than 16 levels" in done.stderr
    assert f"{bad / f'{PREFIX}{"9" * 30}'}: rank " in done.stderr and "Traceback" not in done.output
