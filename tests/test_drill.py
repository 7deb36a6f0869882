"""Restore drills from the shared store on real checkpoints with the real load, their budget,
history, estimate and the Slurm allocation a production drill submits."""

import json
import os
import shlex
import subprocess

import pytest

from tasks.checkpoint.promote import promote
from tasks.profile import load_profile
from tasks.restore.drill import run_drill
from tasks.restore.history import estimate, read_drills
from infra.local_job.launch import TimedOut
from tasks.restore.launch import load_checkpoint, render_sbatch
from tests.conftest import ROOT, write_job_profile

pytestmark = pytest.mark.slow
CKPTOPS = ROOT / ".venv" / "bin" / "ckptops"


def test_shared_drill_restores_verifies_loads_and_records(save_dir, tmp_path, options):
    promote(save_dir, options, 30)
    profile = load_profile(write_job_profile(tmp_path, save_dir))
    report = run_drill(profile, "shared")
    assert report.ok, report.reason
    assert [p.name for p in report.phases] == ["copy", "verify", "load"]
    assert all(p.seconds > 0 and p.bytes > 1_000_000 for p in report.phases)
    checks = {c["name"]: c for c in report.checks}
    assert checks["iteration"]["detail"] == "loaded 24, manifest 24"
    assert checks["consumed samples"]["detail"] == "loaded 192, manifest 192"
    assert checks["scheduler"]["ok"] and checks["tensors"]["detail"].startswith("8 compared")
    assert list(profile.drill.scratch_dir.iterdir()) == []
    recorded = read_drills(save_dir)
    assert len(recorded) == 1 and recorded[0]["ok"] and recorded[0]["window_seconds"] == pytest.approx(report.window_seconds)


def test_drill_over_budget_fails_and_is_recorded(save_dir, tmp_path, options):
    promote(save_dir, options, 30)
    profile = load_profile(write_job_profile(tmp_path, save_dir, budget=0.001))
    report = run_drill(profile, "shared")
    assert not report.ok and "over the 0.001s budget" in report.reason
    assert read_drills(save_dir)[-1]["ok"] is False


def test_drill_with_nothing_promoted_fails_clearly(save_dir, tmp_path):
    profile = load_profile(write_job_profile(tmp_path, save_dir))
    report = run_drill(profile, "shared")
    assert not report.ok and report.reason == f"{save_dir}: nothing promoted, nothing to restore"
    assert list(profile.drill.scratch_dir.iterdir()) == []


def test_drill_cli_history_estimate_and_plot(save_dir, tmp_path, options):
    promote(save_dir, options, 30)
    path = write_job_profile(tmp_path, save_dir)
    drill = subprocess.run([str(CKPTOPS), "drill", "--source", "shared", "--profile", str(path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert drill.returncode == 0, drill.stderr
    assert drill.stdout.startswith("PASS drill from shared, iteration 24: window ")
    plot = tmp_path / "trend.png"
    history = subprocess.run([str(CKPTOPS), "drills", "--profile", str(path), "--json", "--plot", str(plot)],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    data = json.loads(history.stdout)
    assert len(data["drills"]) == 1 and data["drills"][0]["source"] == "shared"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wrong_dir = subprocess.run([str(CKPTOPS), "drill", str(tmp_path), "--profile", str(path)],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert wrong_dir.returncode == 2 and "not the save directory of profile" in wrong_dir.stderr


def test_estimate_scales_each_phase_to_the_production_size():
    drills = [{"source": "shared", "ok": True, "phases": [
        {"name": "copy", "seconds": 2.0, "bytes": 2 << 30},
        {"name": "verify", "seconds": 1.0, "bytes": 2 << 30},
        {"name": "load", "seconds": 4.0, "bytes": 2 << 30}]},
        {"source": "archive", "ok": False, "phases": []}]
    predicted = estimate(drills, 7 * (1 << 40))
    assert set(predicted) == {"shared"}
    assert predicted["shared"].seconds == pytest.approx(7 * 1024 / 2 * 7.0)
    assert predicted["shared"].representative
    assert predicted["shared"].line(7e12, 36000).endswith("418.1 min, within the 600 min budget")
    assert predicted["shared"].line(7e12, 600).endswith("418.1 min, OVER the 10 min budget")


def test_production_drill_allocation_script(tmp_path):
    profile = load_profile("example-500b")
    tricky = profile.drill.slurm.model_copy(update={"load_command": "echo 'it''s' \"$CKPTOPS_CKPT_STEP\"; touch /tmp/x"})
    script = render_sbatch(tricky, tmp_path / "restore dir", 12000, tmp_path / "report.json", "gpt-500b")
    assert "#SBATCH --partition=drill" in script and "#SBATCH --nodes=8" in script
    assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --time=01:30:00" in script
    assert f"export CKPTOPS_LOAD_DIR='{tmp_path}/restore dir'" in script
    assert "export CKPTOPS_CKPT_STEP=12000" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert shlex.split(srun)[-1] == tricky.load_command  # passed as one argument, never re-parsed
    checked = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr


def test_a_drill_allocation_past_its_timeout_is_cancelled(tmp_path, monkeypatch):
    """Slurm itself is missing here: stand-ins for sbatch (warns, prints its id, never ends) and
    scancel (records its arguments). The job id is found after sbatch's warning."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/sh\necho "sbatch: warning: no account given" >&2\n'
                                    'echo "4242;clusterA"\nexec sleep 600\n')
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/scancel.args\n')
    for tool in ("sbatch", "scancel"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    profile = load_profile("example-500b")
    profile = profile.model_copy(update={"drill": profile.drill.model_copy(update={"load_timeout_seconds": 2})})
    with pytest.raises(TimedOut, match="Slurm job 4242 cancelled"):
        load_checkpoint(profile, tmp_path / "restore", 12000, tmp_path / "report.json")
    assert (tmp_path / "scancel.args").read_text().split() == ["-M", "clusterA", "4242"]
