"""Restore drills on real checkpoints with the real load: jobs of several architectures and
layouts from both sources, resharded loads, what the load reports, its budget, history, estimate,
and the batch script a production drill submits."""

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tasks.archive.copy import archive_checkpoint
from tasks.checkpoint.promote import promote
from tasks.errors import UsageError
from tasks.profile import load_profile
from tasks.restore.drill import run_drill
from tasks.restore.history import estimate, read_drills
from tasks.restore.launch import LoaderShape, render_sbatch
from tests.conftest import ROOT, VARIANTS, saved_events, variant_profile, write_job_profile

CKPTOPS = ROOT / ".venv" / "bin" / "ckptops"


def checks(report) -> dict[str, dict]:
    return {c.name: c for c in report.checks}


def promoted_profile(variety, name, tmp_path, options, **kwargs):
    profile = load_profile(variant_profile(variety, name, tmp_path, **kwargs))
    promote(profile.job.save_dir, options, 30)
    return profile


# What each variant's drill must show: its layout on the drill, and its optimizer's format.
MATRIX = {
    "tp2-distopt-bf16": ("TP 2 x PP 1 x DP 1 (2 ranks)", "optimizer loaded (dp_reshardable)"),
    "dp2-other-shape": ("TP 1 x PP 1 x DP 1 (1 ranks)", "optimizer loaded (dp_reshardable)"),
    "pp2": ("TP 1 x PP 2 x DP 1 (2 ranks)", "optimizer loaded"),
    "tp2-bf16": ("TP 2 x PP 1 x DP 1 (2 ranks)", "optimizer loaded"),
    "llama-like": ("TP 1 x PP 1 x DP 1 (1 ranks)", "optimizer loaded"),
    "async-wsd": ("TP 1 x PP 1 x DP 1 (1 ranks)", "optimizer loaded"),
    "own-loop-groups": ("TP 1 x PP 1 x DP 1 (1 ranks)", "optimizer loaded"),
    "bridge": ("TP 1 x PP 1 x DP 1 (1 ranks)", "optimizer loaded"),
}


def last_lr(variety, name) -> float:
    """The learning rate the job itself logged at its last iteration (Megatron-LM's line, or the
    other loop's own)."""
    log = (variety[name].parent / f"{name}-train.log").read_text()
    values = re.findall(r"(?:learning rate: | lr )([0-9.]+E?e?[-+]?[0-9]+)", log)
    return float(values[-1])


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_drills_from_both_sources_load_jobs_of_every_shape(variety, name, tmp_path, options):
    profile = promoted_profile(variety, name, tmp_path, options)
    archived = archive_checkpoint(profile.job.save_dir, profile, force=True)
    assert archived.committed, archived.message
    for source in ("shared", "archive"):
        report = run_drill(profile, source)
        assert report.ok, f"{source}: {report.reason}"
        found = checks(report)
        layout, optimizer = MATRIX[name]
        assert layout in found["model"].detail and optimizer in found["model"].detail
        newest = VARIANTS[name].train_iters
        assert found["iteration"].detail == f"loaded {newest}, manifest {newest}"
        assert found["scheduler"].ok and "(samples of the checkpoint)" in found["scheduler"].detail
        ranks = (
            report.layout["tensor_parallel"]
            * report.layout["pipeline_parallel"]
            * report.layout["data_parallel"]
        )
        load = json.loads(Path(report.log).with_suffix(".load.json").read_text())
        # Every rank compared its own sample, optimizer state included.
        assert len(load["ranks"]) == ranks and all(
            r["compared"] and not r["mismatches"] for r in load["ranks"]
        )
        assert all(any(key.startswith("optimizer.") for key in r["compared"]) for r in load["ranks"])
        assert f"on {ranks} ranks, differing: none" in found["tensors"].detail
        assert Path(report.log).read_text().count(f"drill: loaded iteration {newest}") == 1
    assert list(profile.drill.scratch_dir.iterdir()) == []


def test_args_missing_from_the_checkpoint_are_taken_from_the_tensor_shapes(variety, tmp_path, options):
    profile = promoted_profile(variety, "dp2-other-shape", tmp_path, options)
    report = run_drill(profile, "shared")
    assert report.ok, report.reason
    assert (
        "inferred from the tensor shapes: num_layers=3 (missing from the args; from "
        "decoder.layers.self_attention.linear_qkv.weight [3, 288, 96])"
    ) in checks(report)["model"].detail


def test_a_tp2_job_loads_as_tp1_x_dp2_from_both_sources(variety, tmp_path, options):
    profile = promoted_profile(
        variety, "tp2-bf16", tmp_path, options, drill_extra=", layout: {tensor_parallel: 1, data_parallel: 2}"
    )
    assert archive_checkpoint(profile.job.save_dir, profile, force=True).committed
    for source in ("shared", "archive"):
        report = run_drill(profile, source)
        assert report.ok, report.reason
        detail = checks(report)["model"].detail
        assert (
            "on TP 1 x PP 1 x DP 2 (2 ranks)" in detail
            and "RNG state not loaded: the TP/PP layout changed" in detail
        )
        assert "16 compared with the stored bytes on 2 ranks" in checks(report)["tensors"].detail


def test_a_pp2_job_loads_as_pp1(variety, tmp_path, options):
    profile = promoted_profile(
        variety, "pp2", tmp_path, options, drill_extra=", layout: {pipeline_parallel: 1}"
    )
    report = run_drill(profile, "shared")
    assert report.ok, report.reason
    assert "on TP 1 x PP 1 x DP 1 (1 ranks)" in checks(report)["model"].detail


def test_a_bucketwise_distributed_optimizer_is_not_resharded_across_tp(variety, tmp_path, options):
    profile = promoted_profile(
        variety, "tp2-distopt-bf16", tmp_path, options, drill_extra=", layout: {tensor_parallel: 1}"
    )
    report = run_drill(profile, "shared")
    assert not report.ok
    assert report.reason.startswith(
        "optimizer state saved as 'dp_reshardable' cannot be loaded on TP 1 x PP 1 "
        "(the checkpoint's is TP 2 x PP 1); Megatron-LM refuses this too"
    )
    assert f"log: {report.log}" in report.reason and "LayoutError" in Path(report.log).read_text()


def test_a_checkpoint_whose_args_cannot_build_its_model_fails_naming_the_arg(variety, tmp_path, options):
    profile = promoted_profile(variety, "no-heads-arg", tmp_path, options)
    report = run_drill(profile, "shared")
    assert not report.ok and [p.name for p in report.phases] == ["copy", "verify"]
    assert report.reason.startswith(
        "args.num_attention_heads: missing from the checkpoint's args, and the "
        "tensor shapes cannot tell the number of heads (rank 0; log: "
    )
    assert read_drills(profile.job.save_dir)[-1]["reason"] == report.reason


def test_a_jobs_own_model_provider_builds_the_model(variety, tmp_path, options):
    profile = promoted_profile(
        variety,
        "tp2-bf16",
        tmp_path,
        options,
        drill_extra=", model_provider: 'tests.helpers.model_provider:gpt_from_args'",
    )
    report = run_drill(profile, "shared")
    assert report.ok, report.reason
    assert checks(report)["model"].detail.startswith("tests.helpers.model_provider:gpt_from_args; on TP 2")


def test_the_loads_own_first_error_is_the_reason_and_its_log_is_kept(variety, tmp_path, options):
    profile = promoted_profile(
        variety,
        "llama-like",
        tmp_path,
        options,
        drill_extra=", model_provider: 'tests.helpers.model_provider:broken'",
    )
    report = run_drill(profile, "shared")
    assert not report.ok
    assert report.reason.startswith(
        "RuntimeError: no layer type for 2 layers in this provider (rank 0; log: "
    )
    log = Path(report.log)
    assert (
        log.parent == profile.job.save_dir / ".ckptops-history" / "drills" and "Traceback" in log.read_text()
    )
    assert list(profile.drill.scratch_dir.iterdir()) == []


def test_a_model_provider_that_does_not_import_is_a_usage_error(variety, tmp_path, options):
    path = variant_profile(
        variety, "llama-like", tmp_path, drill_extra=", model_provider: 'nowhere.to_be:found'"
    )
    promote(load_profile(path).job.save_dir, options, 30)
    with pytest.raises(UsageError, match="drill.model_provider 'nowhere.to_be:found': cannot be imported"):
        run_drill(load_profile(path), "shared")
    cli = subprocess.run(
        [str(CKPTOPS), "drill", "--profile", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert cli.returncode == 2 and "nowhere.to_be:found" in cli.stderr and "Traceback" not in cli.stderr
    assert read_drills(load_profile(path).job.save_dir) == []


def test_shared_drill_of_the_default_job_is_recorded(save_dir, tmp_path, options):
    promote(save_dir, options, 30)
    profile = load_profile(write_job_profile(tmp_path, save_dir))
    report = run_drill(profile, "shared")
    assert report.ok, report.reason
    assert [p.name for p in report.phases] == ["copy", "verify", "load"]
    assert all(p.seconds > 0 and p.bytes > 1_000_000 for p in report.phases)
    found = checks(report)
    assert found["iteration"].detail == "loaded 24, manifest 24"
    assert found["consumed samples"].detail == "loaded 192, manifest 192"
    assert set(found) == {"model", "iteration", "consumed samples", "scheduler", "tensors"}
    assert list(profile.drill.scratch_dir.iterdir()) == []
    recorded = read_drills(save_dir)
    assert (
        len(recorded) == 1
        and recorded[0]["ok"]
        and recorded[0]["window_seconds"] == pytest.approx(report.window_seconds)
    )
    assert recorded[0]["log"] == report.log


def test_drill_over_budget_fails_and_is_recorded(save_dir, tmp_path, options):
    promote(save_dir, options, 30)
    profile = load_profile(write_job_profile(tmp_path, save_dir, budget=0.001))
    report = run_drill(profile, "shared")
    assert not report.ok and "over the 0.001s budget" in report.reason
    assert read_drills(save_dir)[-1]["ok"] is False


def test_drill_with_nothing_promoted_fails_clearly(save_dir, tmp_path):
    profile = load_profile(write_job_profile(tmp_path, save_dir))
    report = run_drill(profile, "shared")
    assert not report.ok and report.reason == f"{save_dir}: nothing promoted"
    assert list(profile.drill.scratch_dir.iterdir()) == []


def test_drill_cli_history_estimate_and_plot(save_dir, tmp_path, options):
    promote(save_dir, options, 30)
    path = write_job_profile(tmp_path, save_dir)
    drill = subprocess.run(
        [str(CKPTOPS), "drill", "--source", "shared", "--profile", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert drill.returncode == 0, drill.stderr
    assert drill.stdout.startswith("PASS drill from shared, iteration 24: window ")
    plot = tmp_path / "trend.png"
    history = subprocess.run(
        [str(CKPTOPS), "drills", "--profile", str(path), "--json", "--plot", str(plot)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(history.stdout)
    assert len(data["drills"]) == 1 and data["drills"][0]["source"] == "shared"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wrong_dir = subprocess.run(
        [str(CKPTOPS), "drill", str(tmp_path), "--profile", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert wrong_dir.returncode == 2 and "not the save directory of profile" in wrong_dir.stderr


def test_estimate_scales_each_phase_to_the_production_size():
    drills = [
        {
            "source": "shared",
            "ok": True,
            "phases": [
                {"name": "copy", "seconds": 2.0, "bytes": 2 << 30},
                {"name": "verify", "seconds": 1.0, "bytes": 2 << 30},
                {"name": "load", "seconds": 4.0, "bytes": 2 << 30},
            ],
        },
        {"source": "archive", "ok": False, "phases": []},
    ]
    predicted = estimate(drills, 7 * (1 << 40))
    assert set(predicted) == {"shared"}
    assert predicted["shared"].seconds == pytest.approx(7 * 1024 / 2 * 7.0)
    assert predicted["shared"].representative
    assert predicted["shared"].line(7e12, 36000).endswith("418.1 min, within the 600 min budget")
    assert predicted["shared"].line(7e12, 600).endswith("418.1 min, OVER the 10 min budget")


def test_production_drill_allocation_script(tmp_path):
    profile = load_profile("example-500b")
    slurm = profile.drill.slurm.model_copy(
        update={"prelude": "module load cuda/12 # it's", "account": "ml team"}
    )
    arguments = [
        "--checkpoint",
        str(tmp_path / "restore dir" / "iter_0012000"),
        "--report",
        str(tmp_path / "r.json"),
    ]
    script = render_sbatch(
        slurm, LoaderShape(8, 8, 64), arguments, tmp_path / "job.log", "ckptops-drill-gpt-500b"
    )
    for directive in (
        "--partition=drill",
        "--nodes=8",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--time=01:30:00",
        "--exclusive",
        "'--account=ml team'",
    ):
        assert f"#SBATCH {directive}" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    words = shlex.split(srun)
    assert words[:5] == [
        "srun",
        "--kill-on-bad-exit=1",
        "/opt/ckptops/.venv/bin/python",
        "-m",
        "tasks.restore.loader",
    ]
    assert words[5:] == arguments  # each argument one word, never re-parsed by the shell
    checked = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr


def test_a_promoted_checkpoint_resaved_since_is_not_drilled(save_dir, tmp_path, options):
    """Megatron re-saving into the promoted directory: its manifest describes another save."""
    promote(save_dir, options, 30)
    metadata = save_dir / "iter_0000024" / "metadata.json"
    metadata.write_text(metadata.read_text() + " ")  # a new save identity (size and time)
    profile = load_profile(write_job_profile(tmp_path, save_dir))
    report = run_drill(profile, "shared")
    assert not report.ok
    assert report.reason == "iter_0000024: promoted but its manifest does not say valid for this save"
    assert [p.name for p in report.phases] == []


def test_a_loop_with_param_groups_of_its_own_drills_on_the_saved_groups(variety, tmp_path, options):
    profile = promoted_profile(variety, "own-loop-groups", tmp_path, options)
    report = run_drill(profile, "shared")
    assert report.ok, report.reason
    found = checks(report)
    # Its groups' values are not what its args imply: the saved ones are loaded, and said.
    adopted = "optimizer 0 group 0: max_lr 0.003 from the checkpoint (the args imply 0.001"
    assert adopted in found["model"].detail
    lr = float(found["scheduler"].detail.rsplit("lr ", 1)[1])
    assert lr == pytest.approx(last_lr(variety, "own-loop-groups"), rel=1e-3) and lr > 2e-3


def test_a_wsd_schedule_saved_in_the_background_drills_at_its_logged_lr(variety, tmp_path, options):
    profile = promoted_profile(variety, "async-wsd", tmp_path, options)
    report = run_drill(profile, "shared")
    assert report.ok, report.reason
    lr = float(checks(report)["scheduler"].detail.rsplit("lr ", 1)[1])
    # The WSD decay comes from the checkpoint's args (its state does not keep it): at the end
    # of the decay the rate is the minimum, as Megatron-LM logged it.
    assert lr == pytest.approx(last_lr(variety, "async-wsd"), rel=1e-6) and lr == pytest.approx(1e-4)


def test_the_saved_event_follows_megatron_lms_tracker_for_async_and_plain_saves(variety):
    # Each event arrived once the save was finished: the tracker already named its iteration
    # (an async save only schedules the write; its event waits for the finalize step).
    assert saved_events(variety, "async-wsd") == [[2, "2"], [4, "4"]]
    assert saved_events(variety, "pp2") == [[4, "4"]]
    assert saved_events(variety, "own-loop-groups") == [[4, "4"]]
