"""A verdict cannot be undone by putting old files back: once re-verification found iteration 24
of a real checkpoint invalid (a flipped bit), its earlier manifest (and signature) put back is
refused, signed or not, and the pointer stays where the newest verdicts put it."""

import json

import pytest

from tasks.checkpoint import layout
from tasks.checkpoint.catalog import catalog
from tasks.checkpoint.manifest import UntrustedManifest, read_manifest
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.promote import promote, reverify
from tasks.checkpoint.state import State, VerifyOptions
from tasks.checkpoint.verdicts import log_path
from tests.conftest import flip_byte, iter_dir
from tests.test_signing import keys, options_of, signing_profile  # noqa: F401 (keys: a fixture)
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
