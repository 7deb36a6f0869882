"""Signed manifests (tasks/checkpoint/signing.py) on real checkpoints: a manifest signed with the
profile's key, checked with OpenSSF model signing's own CLI; a shard rewritten with valid CRCs
and its digest updated in the manifest, caught by the signature where the hashes alone pass it;
unknown keys, unsigned manifests, open key files, and the key from a Prefect Secret block."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tasks.archive.copy import archive_checkpoint
from tasks.archive.entries import UnreadableManifest, archived_manifest
from tasks.checkpoint import layout
from tasks.checkpoint.access import Exposed
from tasks.checkpoint.facts import checkpoint_facts
from tasks.checkpoint.manifest import UntrustedManifest, read_manifest, verified_newest_first
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.promote import promote, reverify
from tasks.checkpoint.signing import CannotSign, Trust
from tasks.checkpoint.state import State, VerifyOptions
from tasks.checkpoint.verify import verify_with_profile
from tasks.errors import UsageError
from tasks.profile import load_profile
from tasks.storage.archive import ArchiveStore
from tests.conftest import iter_dir


def keypair(folder: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    private = folder / f"{name}.pem"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    private.chmod(0o600)
    public = folder / f"{name}.pub"
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def profile_for(
    tmp_path: Path,
    save_dir: Path,
    sign: dict | None,
    digest: str = "blake3",
    name: str = "p",
    *extra: str,
    job: str = "signed-job",
):
    lines = [
        *extra,
        f"job: {{name: {job}, save_dir: '{save_dir}', megatron_core_version: '0.19.2', "
        "layout: {data_parallel: 2}}",
        f"verify: {{digest: {digest}, lock_timeout_seconds: 30}}",
    ]
    if sign is not None:
        lines.append(f"sign: {json.dumps(sign, default=str)}")
    path = tmp_path / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return load_profile(path)


@pytest.fixture
def keys(tmp_path) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path / "keys"
    folder.mkdir()
    return {name: keypair(folder, name) for name in ("release", "intruder")}


def signing_profile(tmp_path, save_dir, keys, signer="release", allowed=("release",), required=True):
    sign = {
        "key_file": keys[signer][0],
        "public_keys": [keys[name][1] for name in allowed],
        "required": required,
    }
    return profile_for(tmp_path, save_dir, sign, name=f"{signer}-{'-'.join(allowed)}-{required}")


def options_of(profile) -> VerifyOptions:
    return VerifyOptions.from_profile(profile)


def _model_signing_cli(directory: Path, public: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "model_signing", "verify", "key", str(directory)]
    command += ["--signature", str(directory / layout.SIGNATURE), "--public_key", str(public)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("digest", ["blake3", "sha256"])
def test_a_signed_manifest_names_its_key_and_model_signing_itself_verifies_it(
    save_dir, keys, tmp_path, digest
):
    sign = {"key_file": keys["release"][0], "public_keys": [keys["release"][1]], "required": True}
    profile = profile_for(tmp_path, save_dir, sign, digest=digest)
    directory = iter_dir(save_dir, 24)
    result = verify_with_profile(profile, directory)
    assert result.ok, result.reason
    assert result.signed_by.startswith("release (")
    assert verify_with_profile(profile, directory, read_only=True).signed_by == result.signed_by
    manifest = read_manifest(directory)
    assert manifest.hash_algorithm == digest
    data = (directory / "__1_0.distcp").read_bytes()
    want = blake3.blake3(data) if digest == "blake3" else hashlib.sha256(data)
    assert manifest.file_map()["__1_0.distcp"].hash == want.hexdigest()
    # OpenSSF model signing's own verifier recomputes every digest from the files: its CLI
    # hashes with SHA-256 only; its Python API takes the algorithm the statement names.
    if digest == "sha256":
        checked = _model_signing_cli(directory, keys["release"][1])
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert _model_signing_cli(directory, keys["intruder"][1]).returncode != 0
    else:
        import model_signing

        verifier = model_signing.verifying.Config().use_elliptic_key_verifier(public_key=keys["release"][1])
        verifier.verify(directory, directory / layout.SIGNATURE)
        (directory / "common.pt").write_bytes(b"changed")
        with pytest.raises(ValueError, match="common.pt"):
            verifier.verify(directory, directory / layout.SIGNATURE)


def _forge(target: Path, name: str, data: bytes) -> None:
    """Replace a file with its times kept, so the save looks untouched."""
    before = os.stat(target / name)
    (target / name).write_bytes(data)
    os.utime(target / name, ns=(before.st_atime_ns, before.st_mtime_ns))


def _tamper(save_dir: Path) -> Path:
    """Iteration 20's second rank's shard written over 24's (every record's CRC valid: the same model
    and layout), integrity.json's SHA-256 of it updated, and both files' BLAKE3 put in 24's
    manifest, times kept: what someone who can write the store could do."""
    target = iter_dir(save_dir, 24)
    shard = (iter_dir(save_dir, 20) / "__1_0.distcp").read_bytes()
    _forge(target, "__1_0.distcp", shard)
    integrity = json.loads((target / "integrity.json").read_text())
    integrity["files"]["__1_0.distcp"] = hashlib.sha256(shard).hexdigest()
    _forge(target, "integrity.json", json.dumps(integrity).encode())
    path = target / layout.MANIFEST
    data = json.loads(path.read_text())
    for entry in data["files"]:
        if entry["path"] in ("__1_0.distcp", "integrity.json"):
            content = (target / entry["path"]).read_bytes()
            entry["hash"], entry["size"] = blake3.blake3(content).hexdigest(), len(content)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return target


def test_without_a_signature_a_shard_rewritten_with_valid_crcs_and_its_digest_updated_passes(
    save_dir, tmp_path
):
    """The threat the signature answers: the CRCs and an updated digest all agree with a forgery."""
    unsigned = profile_for(tmp_path, save_dir, None, name="unsigned")
    assert verify_with_profile(unsigned, iter_dir(save_dir, 24)).ok
    _tamper(save_dir)
    result, _ = reverify(save_dir, options_of(unsigned), 24, 30)
    assert result.ok, result.reason


def test_a_forged_shard_in_a_signed_checkpoint_is_never_promoted_or_chosen(save_dir, keys, tmp_path):
    profile = signing_profile(tmp_path, save_dir, keys)
    trust = Trust.of(profile)
    report = promote(save_dir, options_of(profile), 30)
    assert report.current == 24 and all(v.signed_by for v in report.verifications)
    target = _tamper(save_dir)
    with pytest.raises(UntrustedManifest, match=r"manifest.sig: __1_0.distcp differs from its signed digest"):
        read_manifest(target, trust)
    # Read with no policy handed in (another job's save directory), nothing is checked.
    assert read_manifest(target).valid
    # The recovery's and the drill's choice passes it over, post-resume validation refuses it
    # before loading anything from it, and re-verification moves the pointer off it.
    assert next(verified_newest_first(save_dir, trust=trust))[0] == 20
    with pytest.raises(UntrustedManifest, match="differs from its signed digest"):
        checkpoint_facts(target, trust)
    result, report = reverify(save_dir, options_of(profile), 24, 30)
    assert result.state is State.INVALID and "differs from its signed digest" in result.reason
    assert "key release (" in result.reason
    assert read_pointer(save_dir) == report.current == 20
    # The forged manifest is kept as evidence, never replaced by a verdict signed anew.
    assert "__1_0.distcp" in (target / layout.MANIFEST).read_text()
    with pytest.raises(UntrustedManifest):
        read_manifest(target, trust)


def test_a_flipped_verdict_or_an_added_subject_breaks_the_signature(save_dir, keys, tmp_path):
    profile = signing_profile(tmp_path, save_dir, keys)
    trust = Trust.of(profile)
    directory = iter_dir(save_dir, 24)
    assert verify_with_profile(profile, directory).ok
    path = directory / layout.MANIFEST
    original = path.read_text()
    data = json.loads(original)
    data["files"].append({"path": "__9_0.distcp", "size": 1, "hash": "00" * 32})
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    with pytest.raises(UntrustedManifest, match="__9_0.distcp is not among the signed subjects"):
        read_manifest(directory, trust)
    data = json.loads(original)
    data["reason"] = "all checks passed, honestly"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    with pytest.raises(UntrustedManifest, match="manifest.json differs from its signed digest"):
        read_manifest(directory, trust)


def test_a_manifest_signed_by_a_key_not_listed_or_not_signed_is_untrusted(save_dir, keys, tmp_path):
    directory = iter_dir(save_dir, 24)
    intruder = signing_profile(tmp_path, save_dir, keys, signer="intruder", allowed=("intruder",))
    assert verify_with_profile(intruder, directory).signed_by.startswith("intruder (")
    release = Trust.of(signing_profile(tmp_path, save_dir, keys))  # the job's real policy
    with pytest.raises(
        UntrustedManifest, match=r"manifest.sig: signed by key [0-9a-f]{16}, not in sign.public_keys"
    ):
        read_manifest(directory, release)
    assert promote(save_dir, options_of(signing_profile(tmp_path, save_dir, keys)), 30).current == 20

    (directory / layout.SIGNATURE).unlink()
    with pytest.raises(
        UntrustedManifest, match="not signed .manifest.sig missing., and sign.required is set"
    ):
        read_manifest(directory, release)
    optional = Trust.of(signing_profile(tmp_path, save_dir, keys, required=False))
    assert read_manifest(directory, optional).valid  # unsigned is allowed where not required


def test_key_files_others_can_read_and_signing_weak_hashes_are_refused(save_dir, keys, tmp_path):
    keys["release"][0].chmod(0o644)
    profile = signing_profile(tmp_path, save_dir, keys)
    with pytest.raises(Exposed, match=r"release.pem: sign.key_file refused, .*UNPROTECTED PRIVATE KEY FILE"):
        Trust.of(profile)
    with pytest.raises(Exposed, match=r"release.pem: sign.key_file refused"):
        verify_with_profile(profile, iter_dir(save_dir, 24))
    assert not (iter_dir(save_dir, 24) / layout.MANIFEST).exists()
    keys["release"][0].chmod(0o600)
    sign = {"key_file": keys["release"][0], "public_keys": [keys["release"][1]]}
    with pytest.raises(UsageError, match="sign: a signature vouches only for cryptographic digests"):
        profile_for(tmp_path, save_dir, sign, digest="xxh3")
    with pytest.raises(UsageError, match="public_keys: name the keys that may sign"):
        profile_for(tmp_path, save_dir, {"required": True})


def test_an_rsa_signing_key_is_one_line_before_anything_is_signed(tmp_path, keys):
    """model signing signs with elliptic-curve keys only; an RSA key made its signer fail with an
    AttributeError on the first manifest written."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    private = tmp_path / "rsa.pem"
    private.write_bytes(
        rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    private.chmod(0o600)
    sign = {"key_file": private, "public_keys": [keys["release"][1]]}
    with pytest.raises(UsageError) as refused:
        Trust.of(profile_for(tmp_path, tmp_path, sign, name="rsa"))
    line = str(refused.value)
    assert line.startswith(f"{private}: sign.key_file: an RSA key, not an elliptic-curve one; make one with")
    assert "\n" not in line
    private.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    with pytest.raises(
        UsageError, match=f"{private}: sign.key_file: not a PEM private key without a password"
    ):
        Trust.of(profile_for(tmp_path, tmp_path, sign, name="garbled"))


@pytest.mark.parametrize(
    "bundle", [b"{}", b'{"mediaType": 5}', b"\xff not json\n"], ids=["empty", "wrong", "bytes"]
)
def test_a_damaged_signature_is_one_line_naming_it(save_dir, keys, tmp_path, bundle):
    profile = signing_profile(tmp_path, save_dir, keys)
    directory = iter_dir(save_dir, 24)
    assert verify_with_profile(profile, directory).ok
    (directory / layout.SIGNATURE).write_bytes(bundle)
    with pytest.raises(UntrustedManifest) as refused:
        read_manifest(directory, Trust.of(profile))
    line = str(refused.value)
    assert line.startswith(f"{directory / layout.SIGNATURE}: unreadable signature (") and "\n" not in line


def test_the_key_can_come_from_a_prefect_secret_block(save_dir, keys, tmp_path, prefect_api):
    from prefect.blocks.system import Secret

    Secret(value=keys["release"][0].read_text()).save("ckptops-signing-key", overwrite=True)
    sign = {"key_secret": "ckptops-signing-key", "public_keys": [keys["release"][1]], "required": True}
    profile = profile_for(tmp_path, save_dir, sign, name="secret")
    result = verify_with_profile(profile, iter_dir(save_dir, 20))
    assert result.ok and result.signed_by.startswith("release (")
    assert read_manifest(iter_dir(save_dir, 20)).valid


def test_the_archive_signs_its_entry_and_an_altered_archived_manifest_is_not_used(save_dir, keys, tmp_path):
    sign = {"key_file": keys["release"][0], "public_keys": [keys["release"][1]], "required": True}
    archive = f"archive: {{url: '{tmp_path / 'archive'}', keep: 2}}"
    profile = profile_for(tmp_path, save_dir, sign, "blake3", "archived", archive)
    assert promote(save_dir, options_of(profile), 30).current == 24
    assert archive_checkpoint(save_dir, profile).committed
    store, trust = ArchiveStore.from_settings(profile.archive), Trust.of(profile)
    assert archived_manifest(store, "signed-job", 24, trust).valid
    entry = tmp_path / "archive" / "signed-job" / "iter_0000024"
    assert (entry / layout.SIGNATURE).is_file()
    data = json.loads((entry / layout.MANIFEST).read_text())
    data["files"][0]["size"] += 1
    (entry / layout.MANIFEST).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    with pytest.raises(UnreadableManifest, match="manifest.json differs from its signed digest .key release"):
        archived_manifest(store, "signed-job", 24, trust)
    (entry / layout.SIGNATURE).unlink()
    with pytest.raises(
        UnreadableManifest, match="not signed .manifest.sig missing., and sign.required is set"
    ):
        archived_manifest(store, "signed-job", 24, trust)
    # The archive run says which entry it cannot trust, and why, and overwrites nothing; with
    # --force it copies the checkpoint afresh, signed.
    result = archive_checkpoint(save_dir, profile)
    assert not result.committed and "\n" not in result.message
    assert (
        f"{entry / layout.MANIFEST}: not signed (manifest.sig missing), and sign.required" in result.message
    )
    assert archive_checkpoint(save_dir, profile, force=True).committed
    assert archived_manifest(store, "signed-job", 24, trust).valid


def _copy_signed(source: Path, target: Path) -> None:
    for name in (layout.MANIFEST, layout.SIGNATURE):
        shutil.copy2(source / name, target / name)


def test_a_signature_holds_only_for_its_own_job_and_iteration(save_dir, keys, tmp_path):
    other_dir = shutil.copytree(save_dir, tmp_path / "other", copy_function=shutil.copy2)
    sign = {"key_file": keys["release"][0], "public_keys": [keys["release"][1]], "required": True}
    profile = profile_for(tmp_path, save_dir, sign, name="a")
    assert verify_with_profile(profile, iter_dir(save_dir, 24)).ok
    # The same key signs another job: job A's signed manifest, put beside job B's same bytes.
    other = Trust.of(profile_for(tmp_path, other_dir, sign, name="b", job="other-job"))
    _copy_signed(iter_dir(save_dir, 24), iter_dir(other_dir, 24))
    with pytest.raises(UntrustedManifest, match="signs signed-job/iter_0000024, not other-job/iter_0000024"):
        read_manifest(iter_dir(other_dir, 24), other)
    _copy_signed(iter_dir(save_dir, 24), iter_dir(save_dir, 20))  # another iteration of the same job
    with pytest.raises(UntrustedManifest, match="signs signed-job/iter_0000024, not signed-job/iter_0000020"):
        read_manifest(iter_dir(save_dir, 20), Trust.of(profile))


def test_a_digest_that_is_not_hex_is_one_line_not_a_crash(save_dir, keys, tmp_path):
    profile = signing_profile(tmp_path, save_dir, keys)
    directory = iter_dir(save_dir, 24)
    assert verify_with_profile(profile, directory).ok
    data = json.loads((directory / layout.MANIFEST).read_text())
    data["files"][0]["hash"] = "not-a-digest"
    (directory / layout.MANIFEST).write_text(json.dumps(data))
    with pytest.raises(UntrustedManifest, match=r"manifest.json: \S+: its digest 'not-a-digest' is not hex"):
        read_manifest(directory, Trust.of(profile))
    assert [i for i, _ in verified_newest_first(save_dir, trust=Trust.of(profile))] == []


def test_turning_signing_on_judges_an_xxh3_checkpoint_afresh_and_signs_it(save_dir, keys, tmp_path):
    unsigned = profile_for(tmp_path, save_dir, None, digest="xxh3", name="before")
    assert verify_with_profile(unsigned, iter_dir(save_dir, 24)).ok
    profile = signing_profile(tmp_path, save_dir, keys, required=False)
    # Unsigned, and the policy does not require a signature.
    assert read_manifest(iter_dir(save_dir, 24), Trust.of(profile)).hash_algorithm == "xxh3-128"
    result, _ = reverify(save_dir, options_of(profile), 24, 30)
    assert result.ok and result.signed_by.startswith("release (")
    assert any("judged afresh with blake3, to be signed" in c.detail for c in result.checks)
    required = Trust.of(signing_profile(tmp_path, save_dir, keys))
    assert read_manifest(iter_dir(save_dir, 24), required).hash_algorithm == "blake3"


def test_a_copy_that_differs_from_its_manifest_is_not_unpickled(save_dir, keys, tmp_path, monkeypatch):
    from tasks.checkpoint import verify as verify_module

    profile = signing_profile(tmp_path, save_dir, keys)
    assert verify_with_profile(profile, iter_dir(save_dir, 24)).ok
    reference = read_manifest(iter_dir(save_dir, 24))
    copy = shutil.copytree(iter_dir(save_dir, 24), tmp_path / "restored" / "iter_0000024")
    options = options_of(profile)

    def never(*args, **kwargs):
        raise AssertionError("a file of the copy was unpickled before its bytes matched the manifest")

    # Another save's shard (every CRC valid), its times kept.
    _forge(copy, "__1_0.distcp", (iter_dir(save_dir, 20) / "__1_0.distcp").read_bytes())
    monkeypatch.setattr(verify_module, "load_common_state", never)
    result = verify_module.verify_checkpoint(copy, options, reference=reference)
    differs = [c for c in result.checks if c.name == "manifest" and c.failed]
    assert result.state is State.INVALID and [c.file for c in differs] == ["__1_0.distcp"]
    _forge(copy, layout.DCP_METADATA, (copy / layout.DCP_METADATA).read_bytes() + b"\0")  # .metadata itself
    monkeypatch.setattr(verify_module, "load_dcp_metadata", never)
    result = verify_module.verify_checkpoint(copy, options, reference=reference)
    differs = [c for c in result.checks if c.name == "manifest" and c.failed]
    assert result.state is State.INVALID and layout.DCP_METADATA in [c.file for c in differs]


def test_an_archive_that_could_not_sign_under_required_uploads_nothing(save_dir, keys, tmp_path):
    archive = f"archive: {{url: '{tmp_path / 'archive'}', keep: 2}}"
    sign = {"key_file": keys["release"][0], "public_keys": [keys["release"][1]], "required": True}
    assert promote(save_dir, options_of(profile_for(tmp_path, save_dir, sign, "blake3", "k", archive)), 30)
    checks_only = {"public_keys": [keys["release"][1]], "required": True}  # a host without the key
    profile = profile_for(tmp_path, save_dir, checks_only, "blake3", "nokey", archive)
    with pytest.raises(
        UsageError, match="not archived: sign.required is set but its archived manifest could"
    ):
        archive_checkpoint(save_dir, profile)
    assert not (tmp_path / "archive").exists() or not any((tmp_path / "archive").rglob("*.distcp"))
    # Nor does that host rewrite a manifest: an unsigned one would void the signed one.
    before = (iter_dir(save_dir, 24) / layout.MANIFEST).read_bytes()
    with pytest.raises(CannotSign, match="manifest.json: not written: the profile checks signatures"):
        verify_with_profile(profile, iter_dir(save_dir, 24))
    assert (iter_dir(save_dir, 24) / layout.MANIFEST).read_bytes() == before
    assert read_manifest(iter_dir(save_dir, 24)).valid


def test_a_command_on_another_save_directory_says_its_signatures_go_unchecked(save_dir, keys, tmp_path):
    """The profile's policy is its own job's: a save directory it does not name is read with no
    policy, and the command says so; ``profile check`` loads the keys as every command does."""
    from tests.test_cli import ckptops_here

    profile = signing_profile(tmp_path, save_dir, keys)
    other = shutil.copytree(save_dir, tmp_path / "other", copy_function=shutil.copy2)
    done = ckptops_here("verify", iter_dir(other, 24), "--read-only", "-p", profile.source)
    assert done.exit_code == 0, done.output
    assert f"{other}: not signed-job's save directory: signatures not checked" in done.stderr
    own = ckptops_here("verify", iter_dir(save_dir, 24), "--read-only", "-p", profile.source)
    assert own.exit_code == 0 and "signatures not checked" not in own.stderr

    checked = json.loads(ckptops_here("profile", "check", "-p", profile.source, "--json").stdout)
    (sign,) = [c for c in checked["checks"] if c["name"] == "sign"]
    assert sign["outcome"] == "pass" and sign["detail"].startswith(
        "signatures checked (1 allowed key, required)"
    )
    keys["release"][0].chmod(0o644)
    checked = json.loads(ckptops_here("profile", "check", "-p", profile.source, "--json").stdout)
    (sign,) = [c for c in checked["checks"] if c["name"] == "sign"]
    assert sign["outcome"] == "fail" and "release.pem: sign.key_file refused" in sign["detail"]
