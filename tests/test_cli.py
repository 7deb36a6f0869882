"""The ckptops command as users run it: exit codes, one-line errors, no tracebacks."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, iter_dir

CKPTOPS = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "ckptops"


def ckptops(*args):
    return subprocess.run(
        [str(CKPTOPS), *map(str, args)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def ckptops_here(*args):
    """The CLI in this process (exit code, stdout, stderr): for tests of what a command says and
    how it exits, where no process boundary is being tested."""
    from typer.testing import CliRunner

    from tasks.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_verify_valid_exits_0_with_one_line(save_dir):
    result = ckptops("verify", iter_dir(save_dir, 4))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("VALID iter_0000004: all checks passed")
    assert len(result.stdout.strip().splitlines()) == 1


def test_verify_invalid_exits_1_naming_file_and_check_without_traceback(save_dir):
    (iter_dir(save_dir, 4) / "__1_0.distcp").unlink()
    result = ckptops("verify", iter_dir(save_dir, 4))
    assert result.returncode == 1
    assert result.stdout.strip() == (
        "INVALID iter_0000004: __1_0.distcp: referenced by .metadata but missing [files] (+1 more)"
    )
    assert "Traceback" not in result.stderr


def test_verify_in_progress_exits_1(save_dir):
    (iter_dir(save_dir, 24) / "metadata.json").unlink()
    # A save still being written has fresh files: the session's trained copy may be older than
    # the profile's abandon_after_seconds by the time this runs, which would read as abandoned.
    for path in iter_dir(save_dir, 24).iterdir():
        os.utime(path)
    result = ckptops("verify", iter_dir(save_dir, 24))
    assert result.returncode == 1 and result.stdout.startswith("IN-PROGRESS iter_0000024: metadata.json")


def test_verify_json(save_dir):
    result = ckptops("verify", "--json", iter_dir(save_dir, 8))
    data = json.loads(result.stdout)
    assert result.returncode == 0 and data["state"] == "valid" and data["iteration"] == 8
    assert {c["name"] for c in data["checks"]} >= {"crc", "coverage", "state"}


def test_usage_and_unreadable_input_exit_2(save_dir, tmp_path):
    missing = ckptops("verify", tmp_path / "iter_0000001")
    assert (
        missing.returncode == 2
        and missing.stderr.strip() == f"ckptops: {tmp_path}/iter_0000001: no such checkpoint directory"
    )
    assert ckptops("verify").returncode == 2
    bad_profile = tmp_path / "p.yaml"
    bad_profile.write_text("job: {name: x, save_dir: /x}\nretention: {keep_verified: 0}\n")
    result = ckptops("promote", save_dir, "--profile", bad_profile)
    assert (
        result.returncode == 2
        and "retention.keep_verified" in result.stderr
        and "Traceback" not in result.stderr
    )


def test_promote_then_status(save_dir):
    result = ckptops("promote", save_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "latest verified: none -> 24 (first promotion)"
    rows = json.loads(ckptops("status", save_dir, "--json").stdout)
    assert [(r["iteration"], r["state"], r["promoted"]) for r in rows] == [
        (4, "valid", False),
        (8, "valid", False),
        (12, "valid", False),
        (16, "valid", False),
        (20, "valid", False),
        (24, "valid", True),
    ]
    assert all(r["size_bytes"] > 1_000_000 and r["verified_at"] for r in rows)
    table = ckptops("status", save_dir)
    assert table.returncode == 0 and "24" in table.stdout and "valid" in table.stdout
    # Promoting a verified save again and listing read no tensor: neither imports torch (~3 s).
    for command in ("promote", "status"):
        code = (
            f"import sys; from tasks.cli import main; sys.argv = ['ckptops', '{command}', '{save_dir}']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules), file=sys.stderr)"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert done.stderr.strip().splitlines()[-1] == "[]", (command, done.stderr)


def test_retain_and_pins_from_the_command_line(save_dir):
    assert ckptops("promote", save_dir).returncode == 0
    assert ckptops("pin", 4, "--reason", "keep for the paper", "--save-dir", save_dir).returncode == 0
    dry = ckptops("retain", save_dir, "--keep", 3, "--dry-run")
    assert dry.stdout.splitlines()[0] == "would delete: 8, 12"
    done = ckptops("retain", save_dir, "--keep", 3)
    assert done.stdout.splitlines()[0] == "deleted: 8, 12"
    assert sorted(p.name for p in save_dir.glob("iter_*")) == [
        "iter_0000004",
        "iter_0000016",
        "iter_0000020",
        "iter_0000024",
    ]
    assert ckptops("retain", save_dir, "--keep", 1).returncode == 2


def test_environment_problems_exit_2_with_one_line(save_dir, tmp_path):
    for args in (
        ["promote", tmp_path / "nowhere"],
        ["retain", tmp_path / "nowhere"],
        ["status", tmp_path / "nowhere"],
        ["pin", 4, "--reason", "x", "--save-dir", tmp_path / "nowhere"],
    ):
        result = ckptops(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.strip() == f"ckptops: {tmp_path}/nowhere: no such save directory"
    (save_dir / "latest_verified_iteration.txt").mkdir()  # something odd where the pointer goes
    result = ckptops("status", save_dir)
    assert result.returncode == 2 and "latest_verified_iteration.txt" in result.stderr
    assert "Traceback" not in result.stderr


def test_status_ignores_what_is_not_a_checkpoint(save_dir):
    (save_dir / "iter_00000099").mkdir()  # not Megatron's name for iteration 99
    (save_dir / "iter_0000100").symlink_to(save_dir / "iter_0000004")
    (save_dir / "iter_0000200").write_text("a file")
    rows = json.loads(ckptops("status", save_dir, "--json").stdout)
    assert [r["iteration"] for r in rows] == [4, 8, 12, 16, 20, 24]


def test_classify_nccl_judges_several_nodes_by_the_profiles_multi_node_gate(tmp_path):
    """A healthy 2-node, 16-GPU all-reduce (GCP A3 Mega, 338.82 GB/s) is no NVLink failure: the
    rank table's host names say two nodes, so the profile's several-nodes gate applies."""
    profile = tmp_path / "fabric.yaml"
    profile.write_text(
        f"job: {{name: t, save_dir: '{tmp_path}'}}\n"
        f"health: {{nodes: [a], transport: local, raw_dir: '{tmp_path}', "
        "nccl: {pass_gbps: 431, warn_gbps: 410}, pairs: {pass_gbps: 330, warn_gbps: 300}}\n"
    )
    sample = ROOT / "tests/data/health/nccl_allreduce_2node_16xH100_gcp_a3mega.txt"
    result = ckptops("health", "classify", "nccl", sample, "--profile", profile)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("PASS peak out-of-place busbw 338.82 GB/s at >= 1 GiB")
    assert "2 nodes (ztan-mig-235z, ztan-mig-gq73): the several-nodes gate health.pairs" in result.stdout
    one_node = ckptops(
        "health",
        "classify",
        "nccl",
        ROOT / "tests/data/health/synthetic_nccl_c0_na.txt",
        "--profile",
        profile,
    )
    assert "1 node (" in one_node.stdout and "the one-node gate health.nccl" in one_node.stdout


def test_tables_in_a_pipe_keep_every_value_whole(tmp_path):
    """``ckptops drills | cat``: columns are not cut to the terminal's width, so grep finds rows."""
    save = tmp_path / "ckpt"
    history = save / ".ckptops-history" / "drills.jsonl"
    history.parent.mkdir(parents=True)
    drill = {
        "source": "shared",
        "started_at": "2026-11-30T03:00:01.000000+00:00",
        "iteration": 12000,
        "ok": False,
        "reason": "load: " + "x" * 150 + " the end",
        "budget_seconds": 600,
        "window_seconds": 612.5,
        "phases": [{"name": "copy", "seconds": 300.0, "bytes": 7 * 10**12}],
    }
    history.write_text(
        json.dumps(drill) + "\n" + json.dumps({**drill, "source": "archive", "ok": True}) + "\n"
    )
    profile = tmp_path / "p.yaml"
    profile.write_text(
        f"job: {{name: pipe-test, save_dir: '{save}'}}\ndrill: {{scratch_dir: '{tmp_path / 'scratch'}'}}\n"
    )
    result = ckptops("drills", "--profile", profile)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "# restore drills of pipe-test"
    header = lines[1].split()
    assert header[:4] == ["when", "(UTC)", "source", "iter"]
    shared = [line for line in lines if " shared " in line]
    assert len(shared) == 1 and shared[0].rstrip().endswith(" the end") and "x" * 150 in shared[0]


def test_status_lists_the_checkpoints_when_the_pointer_is_garbled(save_dir):
    (save_dir / "latest_verified_iteration.txt").write_text("twelve\n")
    result = ckptops("status", save_dir)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(
        f"ckptops: {save_dir}/latest_verified_iteration.txt: garbled pointer"
    )
    # The table's rows, then the store's line; alarms (a fixture older than the overdue
    # thresholds has some) come after it.
    lines = result.stdout.splitlines()[2:]
    store = next(i for i, line in enumerate(lines) if line.startswith("store "))
    assert [line.split()[0] for line in lines[:store]] == ["4", "8", "12", "16", "20", "24"]
    assert lines[store].startswith(f"store {save_dir}: ") and " free of " in lines[store]


def test_promote_and_pin_of_a_missing_or_negative_iteration_are_usage_errors(save_dir):
    for args in (
        ["promote", save_dir, "--iteration", "99"],
        ["promote", save_dir, "--iteration", "-4"],
        ["pin", "99", "--reason", "x", "--save-dir", save_dir],
        ["pin", "-1", "--reason", "x", "--save-dir", save_dir],
    ):
        result = ckptops(*args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
    assert not (save_dir / ".ckptops-pins").exists() or not list((save_dir / ".ckptops-pins").iterdir())


def test_a_hold_without_a_timezone_is_one_line_naming_it(save_dir):
    hold = save_dir / "latest_verified_iteration.hold"
    hold.write_text(json.dumps({"iteration": 8, "since": "2026-11-30T01:00:00"}))
    result = ckptops("promote", save_dir)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"ckptops: {hold}: garbled rollback hold (since '2026-11-30T01:00:00' has no timezone); "
        "remove it to resume automatic promotion"
    )
    assert not (save_dir / "latest_verified_iteration.txt").exists()


def test_status_names_a_manifest_whose_fields_have_the_wrong_types(save_dir):
    assert ckptops("promote", save_dir).returncode == 0
    path = iter_dir(save_dir, 8) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"] = "all of them"
    path.write_text(json.dumps(manifest))
    result = ckptops("status", save_dir)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip() == f"ckptops: {path}: malformed manifest (files: Input should be a valid list)"
    )
    assert any(line.split()[:2] == ["8", "invalid"] for line in result.stdout.splitlines()[2:])


def test_classify_refuses_a_file_no_tool_output_is_as_large_as(tmp_path):
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse: no disk, but its size says what it is
    result = ckptops("health", "classify", "nccl", huge)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"ckptops: {huge}: 64 MiB is more than any dcgmi or all_reduce_perf output (at most 64 MiB are read)"
    )
