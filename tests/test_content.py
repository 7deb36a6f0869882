"""Verified means right, not only intact: checkpoints of real Megatron-LM runs whose saves wrote a
wrong state with every CRC valid (a NaN weight, +Inf in Adam's first moment, a negative second
moment, a stale re-save, a step counter one ahead, a dropped tensor) are invalid, naming the
tensor or counter, and never promoted; the healthy saves around them stay valid."""

import json
import pickle
import re
import shutil

import pytest
import torch

from tasks.checkpoint.dcp import load_dcp_metadata
from tasks.checkpoint.flow_tasks import tensor_rows
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.promote import promote
from tasks.checkpoint.state import State
from tasks.checkpoint.values import ValueScan, tensor_dtype
from tasks.errors import CkptopsError
from tasks.job.step_records import parse_megatron_log
from tests.conftest import iter_dir, verify_and_record_here


def verify_in_order(save, options) -> dict:
    """Each checkpoint verified and recorded oldest first, as promotion does."""
    return {int(d.name[5:]): verify_and_record_here(d, options) for d in sorted(save.glob("iter_*"))}


def check(result, name):
    return next(c for c in result.checks if c.name == name)


def test_each_wrong_state_is_invalid_naming_the_tensor_or_counter(corrupted, tmp_path, options):
    save = shutil.copytree(corrupted, tmp_path / "checkpoints")
    results = verify_in_order(save, options)
    healthy = [2, 16, 20]  # 16's scheduler was changed: whole and consistent, found by a continuation
    assert all(results[i].state is State.VALID for i in healthy), [results[i].line() for i in healthy]
    assert results[4].state is State.INVALID
    assert (
        "model tensors are byte for byte those of iteration 2: a stale re-save [lineage]" in results[4].reason
    )
    assert results[6].reason.endswith(
        "tensor 'embedding.word_embeddings.weight' chunk [0, 0]: 1 NaN and 0 Inf of 8192 elements [values]"
    )
    assert "'optimizer.state.exp_avg.embedding.word_embeddings.weight' chunk [0, 0]: 0 NaN and 1 Inf" in (
        results[8].reason
    )
    assert (
        "exp_avg_sq.embedding.word_embeddings.weight' chunk [0, 0]: Adam's second moment has a negative"
        in (results[10].reason)
    )
    assert results[12].reason == (
        "optimizer step 13 (common_state.optimizer.state.common_step) is past the iteration 12 [optimizer]"
    )
    dropped = [c.detail for c in results[14].checks if c.name == "lineage" and c.failed]
    assert "tensor 'embedding.word_embeddings.weight' of iteration 2 is missing" in dropped
    assert any("has no model tensor 'embedding.word_embeddings.weight'" in d for d in dropped)
    # A weight a hundred times larger is a warning for a human, not a reason to refuse it.
    assert results[18].state is State.VALID
    spike = check(results[18], "lineage")
    assert spike.outcome == "warn" and "'embedding.word_embeddings.weight'" in spike.detail
    assert "at iteration 16" in spike.detail and float(re.search(r"\((\d+\.\d)x\)", spike.detail)[1]) > 50
    # The manifest keeps what the checks saw, for the next checkpoint's lineage.
    manifest = read_manifest(iter_dir(save, 20))
    assert manifest.schema_version == 3 and manifest.optimizer_step == 20
    stats = manifest.tensors["embedding.word_embeddings.weight"]
    assert stats["nan"] == 0 and stats["shape"] == [128, 64] and stats["norm"] > 0
    assert read_manifest(iter_dir(save, 6)).tensors["embedding.word_embeddings.weight"]["nan"] == 1
    # The UI's tensor table puts the NaN first, and the spike first among the finite ones.
    (nan_row, *_) = tensor_rows([results[6]])
    assert (nan_row["iteration"], nan_row["tensor"], nan_row["nan"]) == (
        6,
        "embedding.word_embeddings.weight",
        1,
    )
    (spike_row, *_) = tensor_rows([results[18]])
    assert spike_row["tensor"] == "embedding.word_embeddings.weight" and spike_row["norm change"].endswith(
        "x"
    )
    assert float(spike_row["norm change"][:-1]) > 50


def test_a_faulty_newest_checkpoint_is_never_promoted(corrupted, tmp_path, options):
    save = shutil.copytree(corrupted, tmp_path / "checkpoints")
    for iteration in (16, 18, 20):
        shutil.rmtree(iter_dir(save, iteration))
    report = promote(save, options, 30)
    assert read_pointer(save) == 2
    assert [v.state for v in report.verifications][1:] == [State.INVALID] * 6


def test_the_distributed_optimizers_state_is_checked_in_its_buckets(corrupted_distopt, tmp_path, options):
    save = shutil.copytree(corrupted_distopt, tmp_path / "checkpoints")
    results = verify_in_order(save, options)
    # The buckets' intra-param padding is never initialised: its values are not the state's.
    assert results[2].state is State.VALID and results[10].state is State.VALID, results[2].reason
    assert check(results[2], "optimizer").detail.startswith("2 step counters agree at 2")
    assert "optimizer step 5" in results[4].reason and "dp_group_idx_" in results[4].reason
    assert "past the iteration 4 [optimizer]" in results[4].reason
    assert "1 NaN and 0 Inf" in results[6].reason and "[values]" in results[6].reason
    assert "bucket_idx_0.exp_avg_sq' chunk [0]: Adam's second moment has a negative" in results[8].reason


def test_an_older_manifest_makes_lineage_not_checkable_never_a_pass(corrupted, tmp_path, options):
    save = tmp_path / "checkpoints"
    for iteration in (2, 16):
        shutil.copytree(iter_dir(corrupted, iteration), iter_dir(save, iteration))
    verify_and_record_here(iter_dir(save, 2), options)
    path = iter_dir(save, 2) / "manifest.json"
    old = json.loads(path.read_text())
    for key in ("tensors", "objects", "optimizer_step"):
        del old[key]
    path.write_text(json.dumps(old | {"schema_version": 2}))
    result = verify_and_record_here(iter_dir(save, 16), options)
    assert result.state is State.VALID
    lineage = check(result, "lineage")
    assert (
        lineage.outcome == "unchecked" and "iteration 2's manifest has no tensor statistics" in lineage.detail
    )


def test_a_record_whose_dtype_disagrees_with_metadata_is_invalid_in_one_line(corrupted, tmp_path, options):
    save = tmp_path / "checkpoints"
    directory = shutil.copytree(iter_dir(corrupted, 2), iter_dir(save, 2))
    metadata = load_dcp_metadata(directory / ".metadata")
    metadata.state_dict_metadata["decoder.final_layernorm.weight"].properties.dtype = torch.bfloat16
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    result = verify_and_record_here(directory, options)
    assert result.state is State.INVALID
    assert (
        "tensor 'decoder.final_layernorm.weight' chunk [0]: stored as float32, .metadata says bfloat16"
        in (result.reason)
    )


@pytest.mark.parametrize("misaligned", [0, 1, 3])  # bytes: where in memory the elements start
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2])
def test_values_are_counted_across_buffer_boundaries(dtype, misaligned):
    import io
    import zipfile

    values = torch.linspace(-3, 5, 1001)
    values[[7, 500]] = float("nan")
    values[[9]] = float("inf")
    values[[11]] = -float("inf")
    tensor = values.to(dtype)
    raw = tensor.view(torch.uint8).numpy().tobytes()
    scan = ValueScan(dtype, 0, len(raw))
    for start in range(0, len(raw), 333):  # pieces that split elements
        scan.feed(memoryview(bytearray(bytes(misaligned) + raw[start : start + 333]))[misaligned:])
    found = scan.finish(crc=0)
    wide = tensor.double()
    finite = wide[torch.isfinite(wide)]
    assert found.numel == 1001
    assert found.nan == int(torch.isnan(wide).sum()) and found.inf == int(torch.isinf(wide).sum())
    assert found.min == finite.min().item() and found.max == finite.max().item()
    assert found.sumsq == pytest.approx((finite**2).sum().item(), rel=1e-5)
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    assert tensor_dtype(zipfile.ZipFile(buffer).read("archive/data.pkl")) == dtype


def test_status_and_verify_json_carry_the_warnings_and_the_statistics(corrupted, tmp_path, options):
    from tests.conftest import write_job_profile
    from tests.test_cli import ckptops_here

    save = tmp_path / "checkpoints"
    for iteration in (16, 18):
        shutil.copytree(iter_dir(corrupted, iteration), iter_dir(save, iteration))
    profile = write_job_profile(tmp_path, save)
    verified = ckptops_here("verify", iter_dir(save, 16), "--json", "--profile", profile)
    assert verified.exit_code == 0, verified.output
    tensors = json.loads(verified.output)["tensors"]
    assert tensors["embedding.word_embeddings.weight"]["numel"] == 128 * 64
    assert ckptops_here("verify", iter_dir(save, 18), "--profile", profile).exit_code == 0
    shown = ckptops_here("status", "--json", "--profile", profile)
    rows = {row["iteration"]: row for row in json.loads(shown.output)}
    assert rows[16]["warnings"] == [] and rows[18]["optimizer_step"] == 18
    assert len(rows[18]["warnings"]) == 1, rows[18]
    (warning,) = rows[18]["warnings"]
    assert warning.startswith("tensor 'embedding.word_embeddings.weight': norm") and warning.endswith(
        "[lineage]"
    )
    table = ckptops_here("status", "--profile", profile)
    assert "warnings" in table.output and "norm" in table.output


def test_a_fully_reshardable_saves_steps_are_read_from_its_param_groups(
    corrupted_fully_reshardable, tmp_path, options
):
    save = shutil.copytree(corrupted_fully_reshardable, tmp_path / "checkpoints")
    results = verify_in_order(save, options)
    assert results[2].state is State.VALID and results[6].state is State.VALID, results[6].reason
    assert check(results[6], "optimizer").detail == "2 step counters agree at 6, iteration 6"
    assert results[4].reason == (
        "optimizer step 5 (common_state.optimizer.optimizer.param_groups[0].step) is past the iteration 4 "
        "[optimizer]"
    )


def test_an_fp16_job_that_skipped_iterations_stays_valid(fp16_skipping, tmp_path, options):
    """A job with a loss scaler skips the optimizer step on an overflow: its step counter lags the
    iteration, and a save before its first step has no Adam moments at all. Neither is a fault."""
    save = shutil.copytree(fp16_skipping, tmp_path / "checkpoints")
    results = verify_in_order(save, options)
    assert all(r.state is State.VALID for r in results.values()), [r.line() for r in results.values()]
    first = check(results[4], "lineage")
    assert (first.outcome.value, first.detail) == (
        "warn",
        "no Adam moments saved: the optimizer has not taken a step yet",
    )
    # The steps the job took by each save, from its own log: the iterations whose line counts no
    # skipped iteration (one line per iteration).
    log = fp16_skipping.parent / f"{fp16_skipping.name}-train.log"
    with log.open() as lines:
        steps = parse_megatron_log(log, lines)
    stepped = [int(i) for i, n in zip(steps.iteration, steps.skipped) if n == 0]
    assert stepped and min(stepped) > 4, "the loss scale no longer skips the first iterations"
    for iteration in (8, 12):
        steps = sum(i <= iteration for i in stepped)
        detail = f"1 step counters agree at {steps}, iteration {iteration}"
        assert check(results[iteration], "optimizer").detail == detail
    assert check(results[12], "lineage").outcome.value == "pass"


def test_a_stale_resave_verified_before_its_predecessor_is_judged_again_and_never_promoted(
    corrupted, tmp_path, options
):
    """4 is 2's tensors saved again. Verified first, 4 has nothing to be compared with and is
    found valid; once 2 is verified, 4 is judged again against it (from the manifests), found
    invalid, and never promoted."""
    save = tmp_path / "checkpoints"
    for iteration in (2, 4):
        shutil.copytree(iter_dir(corrupted, iteration), iter_dir(save, iteration))
    early = verify_and_record_here(iter_dir(save, 4), options)
    assert early.ok and check(early, "lineage").detail.startswith(
        "lineage not checked: no earlier verified checkpoint"
    )
    report = promote(save, options, 30)
    assert read_pointer(save) == 2 and not report.ok
    assert [(v.iteration, v.state) for v in report.verifications] == [(2, State.VALID), (4, State.INVALID)]
    stale_line = "are byte for byte those of iteration 2: a stale re-save [lineage]"
    assert stale_line in report.verifications[1].reason
    stale = read_manifest(iter_dir(save, 4))
    assert stale.status is State.INVALID and stale.lineage_from == 2 and stale.verdict == 2
    with pytest.raises(CkptopsError, match="iter_0000004: not promotable, it is invalid"):
        promote(save, options, 30, requested=4)


def test_a_save_judged_against_a_stale_one_is_judged_again_against_the_one_before(
    corrupted, tmp_path, options
):
    """4 (2's tensors again) and then 16 (judged against 4) verified before 2: once 2 is, 4 is
    found stale, and 16 is judged against 2 instead; it holds, and its manifest is left as is."""
    save = tmp_path / "checkpoints"
    for iteration in (2, 4, 16):
        shutil.copytree(iter_dir(corrupted, iteration), iter_dir(save, iteration))
    assert verify_and_record_here(iter_dir(save, 4), options).ok
    assert verify_and_record_here(iter_dir(save, 16), options).ok
    written = (iter_dir(save, 16) / "manifest.json").read_bytes()
    result = verify_and_record_here(iter_dir(save, 2), options)
    assert read_manifest(iter_dir(save, 4)).status is State.INVALID
    assert result.ok and [(v.iteration, v.state) for v in result.rejudged] == [(4, State.INVALID)]
    assert (iter_dir(save, 16) / "manifest.json").read_bytes() == written
    assert read_manifest(iter_dir(save, 16)).lineage_from == 4
    assert promote(save, options, 30).current == 16
