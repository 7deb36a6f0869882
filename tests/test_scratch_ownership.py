"""A drill deletes only what it provably made: a scratch folder holding the owner record ckptops
wrote into it, whose token the job's drill history recorded for that very folder. Anything else
in the scratch dir, whatever its name or age, is reported and left alone."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.checkpoint.promote import promote
from tasks.profile import load_profile
from tasks.restore.history import read_drills
from tasks.restore.scratch import OWNER, make_scratch, remove_scratch
from tests.conftest import ROOT, write_job_profile
from tests.test_cli import ckptops

THREE_DAYS = 3 * 24 * 3600


def killed_drills_scratch(scratch_dir: Path, save_dir: Path) -> Path:
    """The scratch a drill killed with SIGKILL leaves: made by ``make_scratch`` in a process that
    has exited since, with part of a restored copy in it."""
    path = scratch_dir / "drill-shared-20261130T030000-4242-0badcafe"
    code = (
        "import sys; from pathlib import Path; from tasks.restore.scratch import make_scratch; "
        "made = make_scratch(Path(sys.argv[1]), Path(sys.argv[2]), 'shared-20261130T030000-4242'); "
        "(made.path / 'restore').mkdir(); (made.path / 'restore' / '__0_0.distcp').write_bytes(bytes(4096))"
    )
    subprocess.run([sys.executable, "-c", code, path, save_dir], check=True, timeout=120, cwd=ROOT)
    return path


def aged(path: Path) -> None:
    then = time.time() - THREE_DAYS
    for item in [*path.rglob("*"), path]:
        os.utime(item, (then, then))


def contents(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_drill_removes_only_its_own_leftovers_and_reports_the_rest(save_dir, trained, tmp_path, options):
    promote(save_dir, options, 30)
    path = write_job_profile(tmp_path, save_dir)
    scratch = load_profile(path).drill.scratch_dir
    killed = killed_drills_scratch(scratch, save_dir)
    # Named like drills' scratch, three days old: a team's save directory, a user's notes, a
    # folder holding a copy of the killed drill's owner record, and a link to the notes.
    prod = shutil.copytree(trained, scratch / "drill-prod")
    notes = scratch / "drill-notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep this\n")
    copied = scratch / "drill-copied"
    copied.mkdir()
    shutil.copy(killed / OWNER, copied / OWNER)
    (scratch / "drill-link").symlink_to(notes)
    for folder in (prod, notes, copied):
        aged(folder)
    before = {folder: contents(folder) for folder in (prod, notes, copied)}
    why = {
        prod: "no owner record of ckptops in it",
        notes: "no owner record of ckptops in it",
        copied: f"its owner record is {killed}'s, copied: not that folder",
        scratch / "drill-link": "a symbolic link",
    }

    status = ckptops("status", "--profile", path)
    assert f"stale drill scratch: {killed} (process " in status.stdout
    for folder, reason in why.items():
        assert f"not a drill's scratch: {folder} ({reason}); ckptops leaves it alone" in status.stdout

    drilled = ckptops("drill", "--source", "shared", "--profile", path)
    assert drilled.returncode == 0, drilled.stdout + drilled.stderr
    for folder, reason in why.items():
        assert f"  left alone in the scratch dir: {folder} ({reason})" in drilled.stdout
    (report,) = read_drills(save_dir)
    assert len(report["cleared"]) == 1 and report["cleared"][0].startswith(f"{killed} (process ")
    assert sorted(report["left"]) == sorted(f"{folder} ({reason})" for folder, reason in why.items())
    # The killed drill's scratch and the drill's own are gone; everything else is as it was.
    assert sorted(p.name for p in scratch.iterdir()) == [
        "drill-copied",
        "drill-link",
        "drill-notes",
        "drill-prod",
    ]
    assert {folder: contents(folder) for folder in before} == before


def test_a_drill_removes_its_scratch_only_while_it_is_the_folder_it_made(tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    made = make_scratch(tmp_path / "scratch" / "drill-x", save, "x")
    assert json.loads((made.path / OWNER).read_text())["token"] == made.token
    # Moved away, and another folder put in its place with a copy of its owner record: left alone.
    moved = made.path.rename(tmp_path / "moved")
    made.path.mkdir()
    shutil.copy(moved / OWNER, made.path / OWNER)
    (made.path / "theirs.txt").write_text("not the drill's\n")
    assert remove_scratch(made) == f"{made.path} (not the scratch folder this drill made)"
    assert (made.path / "theirs.txt").read_text() == "not the drill's\n"
    # A link in its place, to the drill's own folder: not followed, nothing removed.
    shutil.rmtree(made.path)
    made.path.symlink_to(moved)
    assert remove_scratch(made).startswith(f"{made.path} (could not be removed: ")
    assert made.path.is_symlink() and (moved / OWNER).is_file()
    # Back in place: removed.
    made.path.unlink()
    moved.rename(made.path)
    assert remove_scratch(made) is None and not made.path.exists()
    # A folder already at a scratch's name is never taken for one.
    taken = tmp_path / "scratch" / "drill-y"
    taken.mkdir()
    (taken / "keep.txt").write_text("keep\n")
    with pytest.raises(FileExistsError):
        make_scratch(taken, save, "y")
    assert sorted(p.name for p in taken.iterdir()) == ["keep.txt"]
