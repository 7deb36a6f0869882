"""The Slurm verify engine on the real local cluster (``make slurm``: slurmctld, nodes n1-n3): the
same verdicts and hashes as the local engine, corruption found across shards, a killed task
retried, a drained node avoided, a file system one node cannot see, and refusals."""

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from prefect.artifacts import Artifact

from flows.verify_and_promote import verify_and_promote
from tasks.checkpoint.dcp import load_dcp_metadata
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.shards import plan_shards
from tasks.checkpoint.state import State, VerifyOptions
from tasks.checkpoint.verify import verify_checkpoint
from tasks.profile import load_profile
from tests.conftest import ROOT, VARIANTS, flip_byte, iter_dir
from tests.helpers.poll import until
from tests.test_cli import CKPTOPS

MB = 1 << 20


def write_profile(tmp_path: Path, save_dir: Path, layout: str = "data_parallel: 2", **slurm) -> Path:
    """1 MB hash segments, so the test checkpoints' files are split over the shards; BLAKE3, whose
    32-byte segment digests the shard results carry (XXH3's are 16)."""
    settings = {
        "nodes": 3,
        "partition": "debug",
        "time_limit": "00:10:00",
        "work_dir": str(tmp_path / "work"),
        **slurm,
    }
    profile = {
        "job": {
            "name": "slurm-verify",
            "save_dir": str(save_dir),
            "megatron_core_version": "0.19.2",
            "layout": yaml.safe_load(layout),
        },
        "verify": {
            "segment_mb": 1,
            "digest": "blake3",
            "lock_timeout_seconds": 30,
            "engine": "slurm",
            "slurm": settings,
        },
    }
    path = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def verify_with(engine: str, directory: Path, profile: Path):
    prof = load_profile(profile)
    options = VerifyOptions.from_profile(prof, directory.parent, engine=engine)
    return verify_checkpoint(directory, options)


def start_cli(directory: Path, profile: Path, *extra) -> subprocess.Popen:
    argv = [CKPTOPS, "verify", directory, "--engine", "slurm", "--json", "--profile", profile, *extra]
    return subprocess.Popen(
        list(map(str, argv)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )


def reading(tmp_path: Path) -> dict[str, dict]:
    """First attempts under way, by node: shard, pid and bytes read (from their progress notes)."""
    found = {}
    for note in (tmp_path / "work").glob("*/progress/shard-*-attempt-0.json"):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(note.read_text())
            data["shard"] = int(note.name.split("-")[1])
            found[data["node"]] = data
    return found


def finish(process: subprocess.Popen) -> tuple[int, dict | None, str]:
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, json.loads(stdout) if stdout.strip() else None, stderr


def test_the_slurm_engine_gives_the_local_engines_verdicts_and_hashes(
    slurm_conf, trained, variety, medium_trained, tmp_path
):
    directories = {iter_dir(trained, 24): "data_parallel: 2", iter_dir(medium_trained, 4): "data_parallel: 2"}
    directories |= {iter_dir(variety[name], 4): VARIANTS[name].layout for name in variety}
    shards = {}
    for directory, layout in directories.items():
        profile = write_profile(tmp_path, directory.parent, layout)
        local, remote = verify_with("local", directory, profile), verify_with("slurm", directory, profile)
        assert local.state is State.VALID, local.reason
        assert (remote.state, remote.reason) == (local.state, local.reason), directory
        assert remote.manifest.files == local.manifest.files, directory
        assert remote.manifest.verifier["engine"] == "slurm"
        assert {row["nodes"] for row in remote.shards} <= {"n1", "n2", "n3"}
        assert all(row["state"] == "done" for row in remote.shards)
        shards[directory] = remote.shards
    assert len(shards[iter_dir(medium_trained, 4)]) == 3  # 43 MB in 1 MB segments: one shard per node
    assert not list((tmp_path / "work").iterdir())  # a finished run leaves nothing behind


def test_a_flipped_byte_in_the_middle_of_a_large_file_is_found_and_named(
    slurm_conf, medium_save_dir, tmp_path
):
    directory = iter_dir(medium_save_dir, 4)
    path = directory / "__1_0.distcp"
    sizes = {p.name: p.stat().st_size for p in directory.iterdir()}
    spread = [s.index for s in plan_shards(sizes, 3, MB) for p in s.pieces if p.name == path.name]
    assert len(spread) >= 2  # the file is read by more than one node
    flip_byte(path, sizes[path.name] // 2)
    profile = write_profile(tmp_path, medium_save_dir)
    local, remote = verify_with("local", directory, profile), verify_with("slurm", directory, profile)
    assert local.state is State.INVALID
    assert (remote.state, remote.reason) == (local.state, local.reason)
    assert remote.reason.startswith("__1_0.distcp: ") and "[crc]" in remote.reason


def test_a_shard_task_killed_midway_is_retried_on_another_node(slurm_conf, medium_save_dir, tmp_path):
    directory = iter_dir(medium_save_dir, 4)
    profile = write_profile(tmp_path, medium_save_dir, max_read_mbps=4)
    expected = verify_with("local", directory, profile)
    process = start_cli(directory, profile)
    victim = until(
        lambda: next((n for n in reading(tmp_path).values() if n["bytes"] > MB), None), 120, "a shard reading"
    )
    os.kill(victim["pid"], signal.SIGKILL)
    code, result, stderr = finish(process)
    assert code == 0, stderr
    assert result["state"] == "valid"
    row = result["shards"][victim["shard"]]
    first, retry = row["nodes"].split(" -> ")
    assert first == victim["node"] and retry != first and row["state"] == "done"
    assert f"shard {victim['shard']} failed on {victim['node']}" in stderr
    assert read_manifest(directory).files == expected.manifest.files


def test_a_hung_shard_task_is_overtaken_by_a_retry_and_then_stopped(slurm_conf, medium_save_dir, tmp_path):
    directory = iter_dir(medium_save_dir, 4)
    profile = write_profile(
        tmp_path, medium_save_dir, max_read_mbps=4, straggler_factor=1.5, straggler_min_seconds=0
    )
    process = start_cli(directory, profile)
    running = until(
        lambda: (r := reading(tmp_path)) and len(r) == 3 and all(n["bytes"] > 0 for n in r.values()) and r,
        120,
        "three shards reading",
    )
    hung = running["n1"]
    os.kill(hung["pid"], signal.SIGSTOP)  # as a read stuck on a dead mount: alive, silent
    try:
        code, result, stderr = finish(process)
        assert code == 0, stderr
        assert result["state"] == "valid"
        row = result["shards"][hung["shard"]]
        assert row["nodes"].startswith("n1 -> ") and row["state"] == "done"
        assert f"shard {hung['shard']} straggling on n1: retrying on" in stderr
        # The hung attempt's step was ended with the run: nothing left on the node.
        until(lambda: not Path(f"/proc/{hung['pid']}").exists(), 60, "the hung task to be ended")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung["pid"], signal.SIGKILL)


@pytest.fixture
def drained_later(slurm_conf):
    yield lambda node: subprocess.run(
        ["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=ckptops-test"],
        check=True,
        timeout=30,
    )
    subprocess.run(["scontrol", "update", "NodeName=n[1-3]", "State=RESUME"], capture_output=True, timeout=30)


def test_a_node_drained_during_the_run_is_avoided(drained_later, medium_save_dir, tmp_path):
    directory = iter_dir(medium_save_dir, 4)
    profile = write_profile(tmp_path, medium_save_dir, max_read_mbps=4)
    process = start_cli(directory, profile)
    running = until(
        lambda: (r := reading(tmp_path)) and len(r) == 3 and all(n["bytes"] > 0 for n in r.values()) and r,
        120,
        "three shards reading",
    )
    drained_later("n2")
    os.kill(running["n1"]["pid"], signal.SIGKILL)
    code, result, stderr = finish(process)
    assert code == 0, stderr
    # n2 was free of the killed shard and first in order, but drained: n3 took it.
    assert result["shards"][running["n1"]["shard"]]["nodes"] == "n1 -> n3"
    assert result["state"] == "valid"


def _pid(pidfile: Path) -> int | None:
    """The pid slurmd wrote, or None while the file is absent or still being written (empty)."""
    try:
        text = pidfile.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


@pytest.fixture
def hidden_on_n2(slurm_conf):
    """Restart n2's slurmd in a mount namespace of its own in which a folder is an empty tmpfs:
    to the tasks n2 starts, the file system there is gone (as when one node loses a mount)."""
    conf = Path(slurm_conf)
    pidfile = conf.parent / "slurmd-n2.pid"

    def restart(prefix: list[str]) -> None:
        old = _pid(pidfile)
        os.kill(old, signal.SIGTERM)
        until(lambda: not Path(f"/proc/{old}").exists(), 60, "n2's slurmd to stop")
        subprocess.run([*prefix, "/usr/sbin/slurmd", "-f", str(conf), "-N", "n2"], check=True, timeout=60)
        until(lambda: _pid(pidfile) not in (None, old), 60, "n2's slurmd to start")

    def hide(folder: Path) -> None:
        mount = f'mount -t tmpfs -o size=1m ckptops-hidden {folder} && exec "$0" "$@"'
        restart(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount])

    yield hide
    restart([])


def test_a_file_system_one_node_cannot_see_is_that_shards_error_not_the_verdict(
    hidden_on_n2, medium_trained, tmp_path
):
    root = tmp_path / "store"
    save = shutil.copytree(medium_trained, root / "checkpoints")
    directory = iter_dir(save, 4)
    profile = write_profile(tmp_path, save)
    expected = verify_with("local", directory, profile)
    hidden_on_n2(root)
    result = verify_with("slurm", directory, profile)
    assert result.state is State.VALID, result.reason
    assert result.manifest.files == expected.manifest.files
    row = next(r for r in result.shards if r["nodes"].startswith("n2 -> "))
    assert f"{directory}: not visible on node n2" in row["errors"]


def test_a_shard_result_that_is_malformed_everywhere_leaves_no_verdict(slurm_conf, save_dir, tmp_path):
    # An "interpreter" that writes a broken result for every shard of its attempt, through srun.
    fake = tmp_path / "broken-python"
    fake.write_text(
        "#!/bin/bash\n"
        'work=$(dirname "$3"); attempt=$5; mkdir -p "$work/results"\n'
        'for k in 0 1 2; do echo "{" > "$work/results/shard-$k-attempt-$attempt.json"; done\n'
    )
    fake.chmod(0o755)
    directory = iter_dir(save_dir, 4)
    profile = write_profile(tmp_path, save_dir, python=str(fake))
    code, result, stderr = finish(start_cli(directory, profile))
    assert code == 2 and result is None
    assert "iter_0000004: no verdict, shard" in stderr and "malformed result" in stderr
    assert "Traceback" not in stderr
    assert not (directory / "manifest.json").exists()


def test_more_nodes_than_in_service_or_no_srun_exit_2_saying_what_is_there(drained_later, save_dir, tmp_path):
    directory = iter_dir(save_dir, 4)
    profile = write_profile(tmp_path, save_dir)
    code, _, stderr = finish(start_cli(directory, profile, "--nodes", "4"))
    assert code == 2
    assert stderr.strip() == "ckptops: --nodes 4: partition debug has 3 node(s) in service (n1, n2, n3)"
    drained_later("n2")
    code, _, stderr = finish(start_cli(directory, profile, "--nodes", "3"))
    assert code == 2 and "has 2 node(s) in service (n1, n3)" in stderr
    no_slurm = subprocess.run(
        [str(CKPTOPS), "verify", str(directory), "--engine", "slurm", "--profile", str(profile)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    assert no_slurm.returncode == 2 and no_slurm.stderr.startswith("ckptops: srun: not found on this host")
    assert not (directory / "manifest.json").exists()


def test_the_flow_verifies_with_the_profiles_engine_and_shows_the_shards(
    prefect_api, slurm_conf, medium_save_dir, tmp_path
):
    profile = write_profile(tmp_path, medium_save_dir)
    state = verify_and_promote(profile=str(profile), return_state=True)
    assert state.is_completed(), state.message
    assert read_pointer(medium_save_dir) == 4
    rows = json.loads(Artifact.get("verify-shards-slurm-verify").data)
    assert [r["shard"] for r in rows] == [0, 1, 2] and all(r["state"] == "done" for r in rows)
    assert sorted(r["nodes"] for r in rows) == ["n1", "n2", "n3"]
    manifest = read_manifest(iter_dir(medium_save_dir, 4))
    assert manifest.verifier["engine"] == "slurm"
    assert [s["nodes"] for s in manifest.verifier["shards"]] == [r["nodes"] for r in rows]


def test_inside_an_allocation_the_shards_run_as_steps_of_it(slurm_conf, medium_save_dir, tmp_path):
    directory = iter_dir(medium_save_dir, 4)
    profile = write_profile(tmp_path, medium_save_dir)

    def under_salloc(nodes: int):
        argv = ["salloc", f"--nodes={nodes}", "--partition=debug", "--time=10", "--job-name=caller"]
        argv += [CKPTOPS, "verify", directory, "--engine", "slurm", "--json", "--profile", profile]
        return subprocess.run(list(map(str, argv)), capture_output=True, text=True, timeout=300, cwd=ROOT)

    inside = under_salloc(3)
    assert inside.returncode == 0, inside.stderr
    result = json.loads(inside.stdout)
    assert result["state"] == "valid" and sorted(r["nodes"] for r in result["shards"]) == ["n1", "n2", "n3"]
    small = under_salloc(2)
    assert small.returncode == 2
    assert "--nodes 3: this allocation (job " in small.stderr and "has 2 node(s) in service" in small.stderr


def test_a_record_outside_any_file_fails_both_engines_the_same_way(slurm_conf, save_dir, tmp_path):
    directory = iter_dir(save_dir, 4)
    metadata = load_dcp_metadata(directory / ".metadata")
    index, info = next((k, v) for k, v in metadata.storage_data.items() if v.relative_path == "__0_0.distcp")
    info.offset = -8  # one flipped sign in a pickled offset: a record no span of the file holds
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    profile = write_profile(tmp_path, save_dir)
    local, remote = verify_with("local", directory, profile), verify_with("slurm", directory, profile)
    assert local.state is State.INVALID
    assert (remote.state, remote.reason) == (local.state, local.reason)
    # The index is checked before any shard is read (issue 56): the record is refused there.
    assert (
        remote.reason.startswith(".metadata: record ")
        and "has offset -8, not an integer in 0.." in remote.reason
    )
    assert "[dcp-metadata]" in remote.reason
