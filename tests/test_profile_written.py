"""A profile says what ckptops acts on, as root in retention and recovery: ``profile init``
writes every value so that it loads back as given, ``profile check`` names a path or job name
whose line says more than YAML reads, and a profile file is read as every file ckptops did not
write is (a regular file, its size and depth bounded, a key given once)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from tasks import adopt
from tasks.errors import UsageError
from tasks.profile import MAX_PROFILE_BYTES, Layout, load_profile
from tests.test_cli import ckptops_here

# Folder and script names YAML would read otherwise, written plainly.
AWKWARD = ["job #1", "a: b", " spaces at both ends ", "two\nlines", "ünïcödé ✓", 'it\'s "quoted"', "#", "- x"]


@pytest.fixture
def layout_of_any(monkeypatch):
    """The layout a checkpoint's args would give, without a trained checkpoint: what init writes
    is under test here, not how it reads args (tests/test_adopt.py reads a real one)."""
    monkeypatch.setattr(
        adopt, "saved_layout", lambda _: {"tensor_parallel": 2, "pipeline_parallel": 1, "data_parallel": 4}
    )


def a_save_dir(parent: Path, name: str) -> Path:
    save = parent / name
    (save / "iter_0000004").mkdir(parents=True)
    return save


@pytest.mark.parametrize("name", AWKWARD)
def test_init_writes_every_value_so_that_it_loads_back_as_given(tmp_path, layout_of_any, name):
    save = a_save_dir(tmp_path, name)
    script = tmp_path / f"run {name.replace(chr(10), ' ')}.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=1\n")
    written = tmp_path / "profile.yaml"
    done = ckptops_here("profile", "init", "--save-dir", save, "--script", script, "--out", written)
    assert done.exit_code == 0, done.output
    profile = load_profile(written)
    assert profile.job.save_dir == save.resolve() and profile.recovery.script == script.resolve()
    assert profile.recovery.log_dir == tmp_path.resolve() / "ckptops-logs"
    assert profile.job.layout.world_size == 8 and profile.recovery.launcher == "slurm"
    # The comments stay comments: nothing of the folder's name leaks out of them.
    assert set(yaml.safe_load(written.read_text())) == {"job", "recovery"}
    check = json.loads(ckptops_here("profile", "check", "-p", written, "--json").stdout)
    assert {c["name"]: c["outcome"] for c in check["checks"]}["profile.values"] == "pass"


def test_init_refuses_a_job_name_no_profile_may_carry(tmp_path, layout_of_any):
    save = a_save_dir(tmp_path, "job")
    done = ckptops_here("profile", "init", "--save-dir", save, "--name", "x\nsave_dir: /etc")
    assert done.exit_code == 2 and "Traceback" not in done.output
    assert done.stderr.strip() == (
        "ckptops: --name 'x\\nsave_dir: /etc': a job's name is lowercase letters, digits and '-', "
        "at most 63, starting with a letter or digit"
    )
    # The folder's own name, made one, is cut to what a profile allows.
    long = a_save_dir(tmp_path, "A" * 80)
    done = ckptops_here("profile", "init", "--save-dir", long)
    assert done.exit_code == 0 and yaml.safe_load(done.stdout)["job"]["name"] == "a" * 63


def test_init_refuses_a_script_it_cannot_read_whole_without_waiting(tmp_path, layout_of_any):
    save = a_save_dir(tmp_path, "job")
    fifo = tmp_path / "job.sbatch"
    os.mkfifo(fifo)
    done = ckptops_here("profile", "init", "--save-dir", save, "--script", fifo)
    assert done.exit_code == 2
    assert done.stderr.strip() == f"ckptops: {fifo}: a FIFO, not a regular file; give the file itself"


def test_check_names_each_path_and_the_name_yaml_reads_short(tmp_path):
    """A hand-written profile: ``job #1`` unquoted is the folder ``job``, which exists; the path
    and the name are named, and check fails although every folder is there."""
    (tmp_path / "job").mkdir()
    (tmp_path / "scratch more").mkdir()
    written = tmp_path / "p.yaml"
    written.write_text(
        f"job:\n  name: job #1\n  save_dir: {tmp_path}/job #1\n"
        f"drill:\n  scratch_dir: {tmp_path}/scratch\n    more\n"
        f"health: {{nodes: [a], transport: local, raw_dir: '{tmp_path}/job #2'}}  # quoted: as written\n"
    )
    done = ckptops_here("profile", "check", "-p", written, "--json")
    assert done.exit_code == 1
    (values,) = [c for c in json.loads(done.stdout)["checks"] if c["name"] == "profile.values"]
    assert values["outcome"] == "fail" and values["file"] == str(written)
    assert values["detail"].split("; ") == [
        "job.name: reads 'job' but line 2 goes on '#1', a comment to YAML: quote the value if that is "
        "part of it, or put the comment on a line of its own",
        f"job.save_dir: reads '{tmp_path}/job' but line 3 goes on '#1', a comment to YAML: quote the "
        "value if that is part of it, or put the comment on a line of its own",
        f"drill.scratch_dir: reads '{tmp_path}/scratch more', folded from lines 5-6: quote it, on one line",
    ]


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    """YAML's loader keeps the last of two: a line slipped in after the name moves the job."""
    written = tmp_path / "p.yaml"
    written.write_text("job:\n  name: x\n  save_dir: /data/x\n  save_dir: /data/y\n")
    with pytest.raises(UsageError) as caught:
        load_profile(written)
    assert str(caught.value) == (
        f"{written}: line 4: save_dir is given twice in one mapping (first at line 3); YAML would keep "
        "the last: give it once"
    )


@pytest.mark.parametrize("kind", ["fifo", "large", "deep"])
def test_a_profile_is_read_bounded_and_refused_in_one_line(tmp_path, kind):
    written = tmp_path / "p.yaml"
    if kind == "fifo":
        os.mkfifo(written)  # read_bytes() waited for a writer for ever
        said = f"{written}: cannot read the profile (a FIFO, not a regular file; give the file itself)"
    elif kind == "large":
        written.write_text("job: {name: x, save_dir: /x}\n" + "#" * MAX_PROFILE_BYTES)
        said = f"{written}: the profile is larger than 1,048,576 bytes"
    else:
        written.write_text("job: {name: x, save_dir: /x}\nnotify: " + "[" * 100 + "]" * 100 + "\n")
        said = f"{written}: profile nests deeper than 64 levels; refused"
    done = ckptops_here("profile", "check", "-p", written)
    assert done.exit_code == 2 and done.stderr.startswith(f"ckptops: {said}")
    assert len(done.stderr.strip().splitlines()) == 1


def test_init_reads_a_real_checkpoint_and_refuses_a_fifo_at_its_metadata_in_one_line(trained, tmp_path):
    """On a real checkpoint (the local job's, DP 2), under a folder name YAML would cut short; then
    with a FIFO planted at its ``.metadata`` (the checkpoint readers refuse it, never wait on it):
    one line naming the checkpoint's folder, exit 2, nothing written."""
    save = tmp_path / "job #1"
    shutil.copytree(trained / "iter_0000024", save / "iter_0000024")
    written = tmp_path / "profile.yaml"
    done = ckptops_here("profile", "init", "--save-dir", save, "--out", written)
    assert done.exit_code == 0, done.output
    profile = load_profile(written)
    assert profile.job.save_dir == save and profile.job.name == "job-1"
    assert profile.job.layout == Layout(data_parallel=2)

    metadata = save / "iter_0000024" / ".metadata"
    metadata.unlink()
    os.mkfifo(metadata)
    done = ckptops_here("profile", "init", "--save-dir", save, "--out", tmp_path / "again.yaml")
    assert done.exit_code == 2 and not (tmp_path / "again.yaml").exists()
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"ckptops: {save / 'iter_0000024'}: .metadata: ") and "FIFO" in line
