"""Megatron-Bridge checkpoints (NeMo's recipes), written by Bridge's own save_checkpoint (0.6.2)
from the Megatron-Core loop (the ``bridge`` variant: 8 iterations, saves at 4 and 8): read as
the same facts as Megatron-LM's, continued from a restored copy by a team's own script through
Bridge's own load and validated from Bridge's own log lines, and each of the silent wrong
resumes Bridge's history reports, reproduced on a copy, refused in one line naming it.

The drill from the shared store and the archive is the drill matrix's ``bridge`` row
(tests/test_drill.py)."""

import json
import shutil
import stat
from pathlib import Path

import pytest
import torch

from tasks.archive.copy import archive_checkpoint
from tasks.checkpoint import dialect
from tasks.checkpoint.facts import CheckpointFacts, checkpoint_facts
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.promote import promote
from tasks.checkpoint.saves import save_report
from tasks.checkpoint.state import VerifyOptions
from tasks.checkpoint.verify import verify_checkpoint
from tasks.job.step_records import load_steps
from tasks.profile import load_profile
from tasks.relaunch.continuity import Continuity
from tasks.restore.drill import run_drill
from tasks.resume.validate import validate_resume
from tasks.storage.archive import ArchiveStore
from tests.conftest import ROOT, VARIANTS, free_port, write_job_profile

CORE_LOOP = ROOT / "tests" / "helpers" / "core_loop.py"
SETTINGS = load_profile().resume
# A save that stopped writing is judged at once, not after the profile's six hours.
JUDGED_NOW = VerifyOptions(job="bridge-test", abandon_after_seconds=0, settle_seconds=0)


def trained_log(variety) -> Path:
    return variety["bridge"].parent / "bridge-train.log"


def test_a_bridge_checkpoint_reads_as_the_facts_a_megatron_lm_one_gives(variety):
    directory = variety["bridge"] / "iter_0000004"
    assert dialect.dialect_of(directory) == dialect.BRIDGE
    facts = checkpoint_facts(directory)
    assert (facts.iteration, facts.consumed, facts.global_batch_size, facts.seq_length) == (4, 32, 8, 32)
    assert facts.layout == {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 2}
    assert facts.scheduler_unit == "samples" and facts.written_by == dialect.BRIDGE
    # Its data loader's per-rank positions, as Bridge's hook saved them (energon/iter_N/).
    assert dialect.data_positions(directory) == {0: 32, 1: 32}
    # A Megatron-LM checkpoint of the same loop is the other dialect.
    assert dialect.dialect_of(variety["own-loop-groups"] / "iter_0000004") == dialect.MEGATRON_LM


def test_its_manifest_holds_bridges_own_files_and_the_tokenizers(variety, tmp_path):
    save = shutil.copytree(variety["bridge"], tmp_path / "save")
    report = promote(save, JUDGED_NOW, 30)
    assert report.current == 8 and all(v.ok for v in report.verifications), report.message
    names = {f.path for f in report.verifications[-1].manifest.files}
    assert {"train_state.pt", "run_config.yaml", "tokenizer/vocab.json", "tokenizer/merges.txt"} <= names
    # The archive entry holds them too, and an object of the tokenizer's gone is a damaged copy.
    profile = load_profile(write_job_profile(tmp_path, save, str(tmp_path / "archive")))
    assert archive_checkpoint(save, profile).committed
    assert archive_checkpoint(save, profile, force=True).message == "iteration 8 is already archived"
    ArchiveStore.from_settings(profile.archive).remove("test-job/iter_0000008/tokenizer/vocab.json")
    again = archive_checkpoint(save, profile, force=True)
    assert again.committed and "had lost 1 of its objects (tokenizer/vocab.json missing)" in again.message
    # A manifest whose file names leave the checkpoint is no manifest: nothing is fetched by it.
    entry = tmp_path / "archive" / "test-job" / "iter_0000008" / "manifest.json"
    planted = json.loads(entry.read_text())
    planted["files"][0]["path"] = "../../escaped"
    entry.write_text(json.dumps(planted))
    report = run_drill(profile, "archive")
    assert not report.ok and "file '../../escaped' is not inside the checkpoint" in report.reason
    assert not list(tmp_path.rglob("escaped"))


LOGS = Path(__file__).parent / "data" / "bridge" / "logs"  # real excerpts (SOURCES.md)


def test_bridges_published_log_lines_read_as_steps():
    lora = load_steps(LOGS / "issue4024-nemotron-super-lora.log")
    assert list(lora.iteration) == [15, 16, 17] and list(lora.consumed) == [7680, 8192, 8704]
    assert list(lora.loss) == [1.059172, 1.052699, 1.028811]  # lm loss, not the MTP losses beside it
    assert list(lora.lr) == [3e-05, 3.2e-05, 3.4e-05] and list(lora.batch_count) == [512] * 3
    # Bridge >= 0.2 reports memory in decimal gigabytes; before, as Megatron-LM does, in MB.
    gigabytes = load_steps(LOGS / "dgxc-llama31-load-iter50-starts-at-1.log")
    assert list(gigabytes.peak_memory) == [194.41e9]
    megabytes = load_steps(LOGS / "verdimrc-llama32-1b-v0.2.0rc7.log")
    assert list(megabytes.iteration) == [10] and list(megabytes.peak_memory) == [
        int(12003.60400390625 * 2**20)
    ]


def test_a_published_load_of_iteration_50_that_started_at_1_is_refused():
    """The dgxc run asked for iter_0000050 (GBS 128) and printed iteration 1 after 128 samples."""
    facts = CheckpointFacts(Path("iter_0000050"), 50, 50 * 128, 128, {"num_steps": 6400}, 0.0, True)
    after = load_steps(LOGS / "dgxc-llama31-load-iter50-starts-at-1.log")
    result = Continuity(facts, None, after, SETTINGS).continuation()
    check = next(c for c in result.checks if c.name == "resume point")
    assert check.outcome.value == "fail" and (check.expected, check.observed) == (
        "first iteration 51",
        "first iteration 1",
    )
    assert check.detail.startswith("resumed from another checkpoint than this one: it started from scratch")


def test_a_teams_bridge_script_continues_a_restored_copy_and_the_resume_validates(variety, tmp_path):
    """The team's script, from the drill contract in docs alone: train from CKPT_LOAD at
    CKPT_STEP up to CKPT_EXIT_INTERVAL, save into CKPT_SAVE only, log to CKPT_LOG. Its log, a
    resume through Bridge's own load, is then validated as the job's own resume would be."""
    save = shutil.copytree(variety["bridge"], tmp_path / "checkpoints")
    switches = " ".join(VARIANTS["bridge"].switches)
    script = tmp_path / "bridge-job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"cd {ROOT}\n"
        'exec > "$CKPT_LOG" 2>&1\n'
        f"exec {ROOT}/.venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 "
        f"--master-port={free_port()} {CORE_LOOP} {switches} "
        '--load "$CKPT_LOAD" --ckpt-step "$CKPT_STEP" --exit-on-missing-checkpoint '
        '--save "$CKPT_SAVE" --save-interval "$CKPT_EXIT_INTERVAL" --train-iters "$CKPT_EXIT_INTERVAL"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    continuation = f", continuation: {{script: '{script}', reference: '{trained_log(variety)}'}}"
    profile = load_profile(write_job_profile(tmp_path, save, drill_extra=continuation))
    assert promote(save, JUDGED_NOW, 30, requested=4).current == 4
    report = run_drill(profile, "shared", continue_steps=4)
    assert report.ok, report.reason
    assert report.certified and report.reason.endswith("and trained on 4 iterations as the original run did")
    after = load_steps(Path(report.continuation_log))
    assert after.kind == "megatron-log" and list(after.iteration) == [5, 6, 7, 8]
    assert list(after.loaded) == [4, 4, 4, 4]  # Bridge's own load line
    before = load_steps(trained_log(variety))
    result = validate_resume(save / "iter_0000004", before, after, SETTINGS)
    assert result.ok, result.line()
    # The run that started from nothing (the first run's own lines: iteration 1 after 8 samples)
    # is what a silent load of no checkpoint prints: refused, naming the Bridge bugs.
    scratch = validate_resume(save / "iter_0000004", before, before, SETTINGS)
    check = next(c for c in scratch.checks if c.name == "resume point")
    assert not scratch.ok and check.observed == "first iteration 1"
    assert "started from scratch" in check.detail
    assert "Megatron-Bridge #4900, #5090, #5260, #3503" in check.detail


def _break(save: Path, bug: str) -> None:
    directory = save / "iter_0000004"
    if bug == "PR#5746":  # the resume pointer and tracker written, then the job died
        (directory / "run_config.yaml").unlink()
    elif bug == "#4900":  # another iteration's state in this one's place
        shutil.copyfile(save / "newer" / "train_state.pt", directory / "train_state.pt")
    elif bug == "PR#5637":  # one data-parallel rank's data loader state gone
        (save / "energon" / "iter_0000004" / "train_dataloader_dprank001.pt").unlink()
    else:  # PR#3312: Bridge <= 0.4's int32 counter after 700K iterations of GBS 3072
        state = torch.load(directory / "train_state.pt", weights_only=True)
        state["consumed_train_samples"] = torch.tensor(700_000 * 3072, dtype=torch.int64).to(torch.int32)
        torch.save(state, directory / "train_state.pt")


REFUSALS = {
    "PR#5746": "run_config.yaml: missing, yet latest_train_state.pt already names this "
    "iteration: the resume pointer was published before the run's config (Megatron-Bridge PR#5746)",
    "#4900": "train_state.pt: says step 8, the directory 4: a resume from it would start "
    "elsewhere (Megatron-Bridge #4900, #5090, #5260, #3503)",
    "PR#5637": "energon/iter_0000004/: 1 data loader state files for data-parallel size 2 "
    "(missing: dprank001): a resume would silently drop the ranks' data positions (Megatron-Bridge PR#5637)",
    "PR#3312": "train_state.pt: consumed_train_samples -2144567296: a wrapped 32-bit counter "
    "(Megatron-Bridge PR#3312) [state]",
}


def test_the_samples_since_the_last_verified_checkpoint_follow_the_schedule(variety, tmp_path):
    """The sum so far counts from the newest verified checkpoint (a run may change its batch size
    at a resume). With a ramp-up each step takes 2 to 8 samples here: Megatron-Core <= 0.18 ramps,
    0.19 ignores the setting, so 4 iterations after 32 samples make 40 to 64."""
    save = shutil.copytree(variety["bridge"], tmp_path / "save")
    for directory in (save / "iter_0000004", save / "iter_0000008"):
        config = directory / "run_config.yaml"
        config.write_text(
            config.read_text().replace("  rampup_batch_size: null", "  rampup_batch_size: [2, 2, 64]")
        )
    assert promote(save, JUDGED_NOW, 30, requested=4).current == 4  # 32 after 4 iterations of 8
    directory = save / "iter_0000008"
    assert verify_checkpoint(directory, JUDGED_NOW).ok  # 64: the global batch size each time
    state = torch.load(directory / "train_state.pt", weights_only=True)
    state["consumed_train_samples"] = torch.tensor(36)
    torch.save(state, directory / "train_state.pt")
    verification = verify_checkpoint(directory, JUDGED_NOW)
    # First the counter, then each rank's data loader state, which still says 64.
    assert verification.reason == (
        "train_state.pt: consumed_train_samples 36, but 32 samples at iteration 4 and 4 iterations of "
        "the run's global batch size make 40 to 64 [state] (+2 more)"
    )


@pytest.mark.parametrize("bug", sorted(REFUSALS))
def test_each_silent_wrong_resume_of_bridges_history_is_refused_naming_it(variety, tmp_path, bug):
    save = shutil.copytree(variety["bridge"], tmp_path / "save")
    (save / "iter_0000008").rename(save / "newer")  # iteration 4 is the newest checkpoint
    _break(save, bug)
    shutil.copyfile(save / "iter_0000004" / "train_state.pt", save / "latest_train_state.pt")
    report = promote(save, JUDGED_NOW, 30)
    (verification,) = report.verifications
    assert not verification.ok and report.current is None and read_pointer(save) is None
    assert verification.reason.startswith(REFUSALS[bug]), verification.reason


def test_bridges_resume_pointer_on_an_incomplete_iteration_is_an_alarm(variety, tmp_path):
    save = shutil.copytree(variety["bridge"], tmp_path / "save")
    (save / "iter_0000008" / "run_config.yaml").unlink()
    alarms = save_report(save, JUDGED_NOW).alarms()
    assert alarms == [
        f"ALERT {save / 'latest_train_state.pt'}: names iteration 8, which is not complete "
        "(run_config.yaml missing): Megatron-Bridge's resume would load it (PR#5746)"
    ]
