"""A verdict cannot be undone by putting old files back: once re-verification found iteration 24
of a real checkpoint invalid (a flipped bit), its earlier manifest (and signature) put back is
refused, signed or not, and the pointer stays where the newest verdicts put it. Nor by removing
the verdict log first: in the job's own save directory a manifest the log does not vouch for (the
log deleted, shortened, or a line lost to a full disk) is verified again, every byte."""

import errno
import json
import logging

import pytest

from tasks.checkpoint import layout, verdicts
from tasks.checkpoint import manifest as manifest_module
from tasks.checkpoint.catalog import catalog
from tasks.checkpoint.manifest import UnboundVerdict, UntrustedManifest, read_manifest, read_signed_manifest
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.promote import promote, reverify
from tasks.checkpoint.state import State, VerifyOptions
from tasks.checkpoint.verdicts import log_path
from tasks.errors import Unreadable
from tests.conftest import flip_byte, iter_dir
from tests.test_signing import keys, options_of, profile_for, signing_profile  # noqa: F401 (keys: a fixture)
from tests.test_verify import tensor_data_offset

OLDER = "an older manifest put back: it is verdict 1, .ckptops-history/verdicts.jsonl records verdict 2"


def _invalidated_with_its_old_files_kept(save_dir, options) -> dict[str, bytes]:
    """Promote 4..24, keep 24's manifest and signature, flip a bit of its shard and re-verify:
    24 is found invalid and the pointer moves to 20. The kept files, by name."""
    assert promote(save_dir, options, 30).current == 24
    directory = iter_dir(save_dir, 24)
    kept = {
        n: (directory / n).read_bytes()
        for n in (layout.MANIFEST, layout.SIGNATURE)
        if (directory / n).exists()
    }
    flip_byte(directory / "__0_0.distcp", tensor_data_offset(directory, "__0_0.distcp"))
    result, report = reverify(save_dir, options, 24, 30)
    assert result.state is State.INVALID and "[crc]" in result.reason
    assert report.current == 20
    return kept


def _put_back(save_dir, kept: dict[str, bytes]) -> None:
    for name, data in kept.items():
        (iter_dir(save_dir, 24) / name).write_bytes(data)


def _refused(save_dir, options) -> None:
    directory = iter_dir(save_dir, 24)
    with pytest.raises(UntrustedManifest, match=f"{directory / layout.MANIFEST}: {OLDER} .invalid, "):
        read_manifest(directory)
    [info] = [i for i in catalog(save_dir, options) if i.iteration == 24]
    assert info.state is State.INVALID and OLDER in info.manifest_error and "\n" not in info.reason
    report = promote(save_dir, options, 30)
    assert report.current == 20 and read_pointer(save_dir) == 20 and not report.changed


def test_a_signed_manifest_put_back_after_it_was_found_invalid_is_refused(save_dir, keys, tmp_path):  # noqa: F811
    options = options_of(signing_profile(tmp_path, save_dir, keys))
    kept = _invalidated_with_its_old_files_kept(save_dir, options)
    assert set(kept) == {layout.MANIFEST, layout.SIGNATURE}
    _put_back(save_dir, kept)
    _refused(save_dir, options)
    # Re-verifying does not take the put-back manifest for a reference either: it is kept as
    # evidence, and the checkpoint stays invalid.
    result, report = reverify(save_dir, options, 24, 30)
    assert result.state is State.INVALID and OLDER in result.reason and report.current == 20


def test_an_unsigned_valid_manifest_put_back_over_a_newer_invalid_verdict_is_refused(save_dir):
    options = VerifyOptions(job="test", megatron_core_version="0.19.2")
    kept = _invalidated_with_its_old_files_kept(save_dir, options)
    assert json.loads(kept[layout.MANIFEST])["status"] == "valid"
    invalid = (iter_dir(save_dir, 24) / layout.MANIFEST).read_bytes()
    _put_back(save_dir, kept)
    _refused(save_dir, options)
    # A verdict whose line the log lost (a crash between the rename and the append) is newer
    # than the log, not older: it is trusted.
    (iter_dir(save_dir, 24) / layout.MANIFEST).write_bytes(invalid)
    log = log_path(save_dir)
    lines = log.read_text().splitlines()
    log.write_text(
        "\n".join(line for line in lines if not ('"iteration": 24' in line and '"verdict": 2' in line)) + "\n"
    )
    assert read_manifest(iter_dir(save_dir, 24)).status is State.INVALID


def _replayed_without_the_log(save_dir, options, cut) -> None:
    """Iteration 24 found invalid, its old valid manifest (and signature) kept; the verdict log
    cut by ``cut`` and the old files put back: not trusted on their word. The checkpoint is listed
    as needing verification again, and the next promotion reads every byte again (the bad CRC
    found once more) and does not move the pointer onto it."""
    kept = _invalidated_with_its_old_files_kept(save_dir, options)
    cut(log_path(save_dir))
    _put_back(save_dir, kept)
    directory = iter_dir(save_dir, 24)
    with pytest.raises(UnboundVerdict, match="not bound to the log"):
        read_manifest(directory, options.trust)
    # Still the reference its bytes are compared with: its hashes are under its signature.
    assert read_signed_manifest(directory, options.trust)[0].valid
    [info] = [i for i in catalog(save_dir, options) if i.iteration == 24]
    assert info.state is State.UNVERIFIED and info.stale and info.reason.startswith("needs verifying again")
    report = promote(save_dir, options, 30)
    assert report.current == 20 and read_pointer(save_dir) == 20
    assert [v.iteration for v in report.invalid] == [24] and "[crc]" in report.invalid[0].reason
    assert read_manifest(directory, options.trust).status is State.INVALID  # bound again


def _deleted(log) -> None:
    log.unlink()


def _cut_to_its_first_line(log) -> None:
    log.write_bytes(log.read_bytes().split(b"\n")[0] + b"\n")


@pytest.mark.parametrize("cut", [_deleted, _cut_to_its_first_line], ids=["deleted", "truncated"])
def test_a_signed_manifest_put_back_after_the_verdict_log_was_cut_is_verified_again(
    save_dir,
    keys,  # noqa: F811
    tmp_path,
    cut,
):
    options = options_of(signing_profile(tmp_path, save_dir, keys))
    _replayed_without_the_log(save_dir, options, cut)


def test_without_sign_required_a_manifest_the_log_lost_is_a_warning_and_never_promoted_alone(
    save_dir, tmp_path, caplog
):
    options = options_of(profile_for(tmp_path, save_dir, None))
    assert options.trust.job == "signed-job" and not options.trust.checks
    with caplog.at_level(logging.WARNING, logger="tasks.checkpoint.catalog"):
        _replayed_without_the_log(save_dir, options, _deleted)
    warned = "not bound to the verdict log (iterations 4, 8, 12, 16, 20, 24)"
    assert any(warned in r.getMessage() for r in caplog.records)


def test_a_line_lost_to_a_full_disk_leaves_a_manifest_that_is_verified_again(save_dir, tmp_path, monkeypatch):
    """The append after the manifest's rename fails (ENOSPC): the new manifest is not trusted on
    its word; the next promotion verifies it again and records its line."""
    options = options_of(profile_for(tmp_path, save_dir, None))
    assert promote(save_dir, options, 30).current == 24
    directory = iter_dir(save_dir, 24)

    def full(path, entry):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(verdicts, "append_jsonl", full)
    written = read_manifest(directory, options.trust)
    with pytest.raises(Unreadable, match="No space left on device"):
        manifest_module.write_manifest(directory, written, options.trust)
    monkeypatch.undo()
    with pytest.raises(UnboundVerdict, match="ends at sequence 6, below this manifest's 7"):
        read_manifest(directory, options.trust)
    report = promote(save_dir, options, 30)
    assert [v.iteration for v in report.verifications] == [24] and report.ok and report.current == 24
    assert read_manifest(directory, options.trust).sequence == 8  # past the one it replaced


def test_a_manifest_without_a_sequence_is_verified_again_under_sign_required_only(tmp_path):
    save_dir = tmp_path / "save"
    (save_dir / "iter_0000024").mkdir(parents=True)
    data = b"{}"
    assert verdicts.unbound(save_dir, 24, None, data, required=False) is None
    assert "written before verdict sequences" in verdicts.unbound(save_dir, 24, None, data, required=True)
    assert "verdicts.jsonl is missing" in verdicts.unbound(save_dir, 24, 1, data, required=False)
    verdicts.record(save_dir, 24, 1, 1, "valid", data, "then")
    verdicts.record(save_dir, 20, 1, 2, "valid", b"other", "then")
    assert verdicts.unbound(save_dir, 24, 1, data, required=True) is None
    assert "records sequence 1 for another manifest" in verdicts.unbound(save_dir, 24, 1, b"[]", False)
    assert "records sequence 2 for iteration 20" in verdicts.unbound(save_dir, 24, 2, data, False)
    assert "ends at sequence 2, below this manifest's 3" in verdicts.unbound(save_dir, 24, 3, data, False)
    assert verdicts.next_sequence(save_dir, None) == 3 and verdicts.next_sequence(save_dir, 9) == 10
