"""Signed manifests: who vouches for a checkpoint's bytes, checked before every use.

A manifest's file hashes find accidents; whoever can write a shard can also write its hash into
the manifest. With ``sign.key_file`` (or ``sign.key_secret``, a Prefect Secret block) every
manifest ckptops writes is signed beside it, in ``manifest.sig``: OpenSSF model signing's format,
an in-toto statement in a DSSE envelope inside a Sigstore bundle, signed with an elliptic-curve
key. Its subjects (model signing's "resources") are the checkpoint's files with their
cryptographic digests (BLAKE3 or SHA-256, ``verify.digest``), and ``manifest.json`` itself, so
neither a shard, nor a hash, nor the verdict can change unseen. The statement's name is
``<job>/iter_NNNNNNN``: a signature is not valid for another checkpoint.

``sign.public_keys`` lists the keys that may sign; ``sign.required`` makes an unsigned manifest
untrusted. The policy is a ``Trust``, built from a profile's ``sign`` section and handed to
whoever reads or writes manifests (``manifest.read_manifest`` and ``write_manifest``, the
archive's entries): nothing is looked up by path, so a save directory no profile names is read
unchecked, and the command says so (``Trust.describe``).

Why model signing's internal modules: its public API (``model_signing.signing.Config.sign``)
hashes every file itself, a second read of a 7 TB checkpoint that verification has just read.
Its manifest, payload, signer and verifier classes take digests computed elsewhere; they are
internal (``model_signing._signing``), hence the exact pin in pyproject.toml. The signature
verifies with model signing's own CLI for every file within one hash segment
(``model_signing verify key --signature manifest.sig --public_key KEY --ignore-paths ... DIR``);
a larger file's digest is over its segments' digests (``tasks.storage.digest``), which it cannot
recompute.
"""

import hashlib
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tasks.checkpoint import layout
from tasks.checkpoint.access import refuse_readable_by_others
from tasks.errors import CkptopsError, UsageError, unreadable
from tasks.storage.digest import ALGORITHMS, CRYPTOGRAPHIC
from tasks.storage.local import atomic_write, clip

SIGNATURE = layout.SIGNATURE


class BadSignature(CkptopsError):
    """A manifest whose signature is missing where required, does not verify, or comes from a key
    the profile does not allow: one line naming the file and the key."""

    exit_code = 2


class CannotSign(CkptopsError):
    """A manifest this host may not write: its profile checks signatures, and it has no key to
    sign with (an unsigned manifest would replace, and so void, a signed one)."""


def key_id(public_pem: bytes) -> str:
    """A public key's id: the SHA-256 of its PEM (SubjectPublicKeyInfo), as model signing records
    it in the bundle's ``publicKey.hint``."""
    return hashlib.sha256(public_pem).hexdigest()


def short(identifier: str) -> str:
    return identifier[:16]


@dataclass(frozen=True)
class AllowedKey:
    name: str  # the public key file's stem, for messages
    path: Path
    identifier: str

    def label(self) -> str:
        return f"{self.name} ({short(self.identifier)})"


def one_line(text: str, limit: int = 300) -> str:
    """A reason as one line: what a parser or a verifier raised may span many (pydantic's errors,
    a bundle's JSON), and a failure is reported in one line naming its file."""
    return clip(" ".join(str(text).split()), limit)


# The curves model signing's key signer and verifier take (Sigstore's).
_CURVES = ("secp256r1", "secp384r1", "secp521r1")
_MAKE_ONE = "make one with: openssl ecparam -genkey -name prime256v1 -noout -out signing.key"


def _not_ec(key) -> str | None:
    """Why ``key`` (a private or public key) is not one model signing signs or verifies with."""
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        if key.curve.name in _CURVES:
            return None
        return f"an elliptic-curve key on {key.curve.name}, not one of {', '.join(_CURVES)}"
    if isinstance(key, (rsa.RSAPrivateKey, rsa.RSAPublicKey)):
        return "an RSA key, not an elliptic-curve one"
    kind = type(key).__name__.removesuffix("PrivateKey").removesuffix("PublicKey")
    return f"a {kind} key, not an elliptic-curve one"


def check_private_key(data: bytes, where: str) -> None:
    """Refuse, in one line naming ``where``, a signing key model signing cannot sign with: not a
    PEM private key without a password, or not an elliptic-curve key on a curve it takes (an RSA
    key among them: its signer would fail on it with an AttributeError)."""
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{where}: not a PEM private key without a password ({one_line(e)})") from None
    problem = _not_ec(key)
    if problem is not None:
        raise UsageError(f"{where}: {problem}; {_MAKE_ONE}")


def _load_public(path: Path) -> AllowedKey:
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
        pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    except OSError as e:
        raise UsageError(f"{path}: sign.public_keys: unreadable ({e.strerror})") from None
    except (ValueError, TypeError) as e:
        raise UsageError(f"{path}: sign.public_keys: not a PEM public key ({one_line(e)})") from None
    problem = _not_ec(key)
    if problem is not None:
        raise UsageError(f"{path}: sign.public_keys: {problem}")
    return AllowedKey(Path(path).stem, Path(path), key_id(pem))


@dataclass
class Trust:
    """Who may sign a job's manifests, whether they must be signed, and the key to sign with."""

    keys: dict[str, AllowedKey] = field(default_factory=dict)
    required: bool = False
    key_file: Path | None = None
    key_secret: str | None = None
    job: str | None = None  # whose checkpoints: a signature names the job and the iteration
    _signer: object = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.keys)), self.required, self.key_file, self.key_secret, self.job))

    @classmethod
    def from_settings(cls, settings, job: str | None = None) -> "Trust":
        if settings is None:
            return cls(job=job)
        if settings.key_file is not None:
            _read_key_file(settings.key_file)
        keys = [_load_public(p) for p in settings.public_keys]
        return cls(
            {k.identifier: k for k in keys}, settings.required, settings.key_file, settings.key_secret, job
        )

    @classmethod
    def of(cls, profile, save_dir: Path | None = None) -> "Trust":
        """The profile's policy (its ``sign`` section) for its own save directory; for any other
        (``save_dir`` given and not the profile's), no policy: the profile does not speak for
        another job's manifests."""
        own = save_dir is None or Path(save_dir).resolve() == Path(profile.job.save_dir).resolve()
        return cls.from_settings(profile.sign, profile.job.name) if own else cls()

    def signs_manifest(self, manifest) -> bool:
        """Whether a manifest written under this policy is signed: a key is here and the
        manifest's digests are cryptographic."""
        return self.signs and signable(manifest)

    def describe(self) -> str:
        """What this policy does to the manifests it reads, for a command's output."""
        if self.key_file is not None:
            signs = f"signs with {self.key_file}"
        elif self.key_secret is not None:
            signs = f"signs with Secret block {self.key_secret!r}"
        else:
            signs = "signs nothing (no key here)"
        if not self.checks:
            return f"signatures not checked (no sign section covers this save directory); {signs}"
        keys = f"{len(self.keys)} allowed key{'s' if len(self.keys) != 1 else ''}"
        return f"signatures checked ({keys}{', required' if self.required else ''}); {signs}"

    @property
    def signs(self) -> bool:
        return self.key_file is not None or self.key_secret is not None

    @property
    def checks(self) -> bool:
        return self.required or bool(self.keys)

    def __getstate__(self) -> dict:
        """Handed to another process (a Prefect task's inputs, a worker): the policy, not the
        loaded signer nor its lock."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_signer", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _signer=None, _lock=threading.Lock())

    def signer(self):
        """model signing's elliptic-curve signer, the key loaded once per process."""
        with self._lock:
            if self._signer is None:
                self._signer = _load_signer(self)
            return self._signer


def _read_key_file(path: Path) -> bytes:
    """The signing key file's bytes, refused in one line if others may read it or it is not a key
    model signing signs with."""
    refuse_readable_by_others(path, "sign.key_file")
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise unreadable(path, e) from None
    check_private_key(data, f"{path}: sign.key_file")
    return data


def _load_signer(trust: Trust):
    from model_signing._signing import sign_ec_key

    if trust.key_file is not None:
        _read_key_file(trust.key_file)
        return sign_ec_key.Signer(Path(trust.key_file))
    from prefect.blocks.system import Secret

    try:
        text = Secret.load(trust.key_secret).get()
    except Exception as e:  # no such block, no server: Prefect's own errors
        raise CkptopsError(
            f"sign.key_secret {trust.key_secret!r}: cannot load the key ({type(e).__name__}: {e})"
        ) from None
    data = str(text).encode()
    check_private_key(data, f"Secret block {trust.key_secret!r}")
    # model signing reads keys from files: a private directory, removed at once.
    with tempfile.TemporaryDirectory(prefix="ckptops-key-") as folder:
        path = Path(folder) / "key.pem"
        atomic_write(path, data, secret=True)
        return sign_ec_key.Signer(path)


def _statement(manifest, manifest_bytes: bytes, name: str, where: str):
    """The signed content, as model signing's manifest: each file and its digest, and
    manifest.json's own digest, under the checkpoint's name (``<job>/iter_NNNNNNN``, from where
    the manifest is). A manifest listing a file twice, or its own name, or a digest that is not
    hex, is no manifest to sign or to trust: ``BadSignature``."""
    from model_signing import manifest as ms
    from model_signing._hashing.hashing import Digest

    paths = [f.path for f in manifest.files]
    if len(set(paths)) != len(paths) or layout.MANIFEST in paths or SIGNATURE in paths:
        raise BadSignature(f"{where}: lists a file twice, or its own name, among its files")
    algorithm = manifest.hash_algorithm
    own = ALGORITHMS[algorithm]()
    own.update(manifest_bytes)
    try:
        items = [
            ms.FileManifestItem(path=PurePosixPath(f.path), digest=Digest(algorithm, bytes.fromhex(f.hash)))
            for f in manifest.files
        ]
    except ValueError:
        bad = next(f for f in manifest.files if not _is_hex(f.hash))
        raise BadSignature(f"{where}: {bad.path}: its digest {bad.hash[:70]!r} is not hex") from None
    items.append(
        ms.FileManifestItem(path=PurePosixPath(layout.MANIFEST), digest=Digest(algorithm, own.digest()))
    )
    serialization = ms.SerializationType.from_args(
        {"method": "files", "hash_type": algorithm, "allow_symlinks": False, "ignore_paths": [SIGNATURE]}
    )
    return ms.Manifest(name, items, serialization)


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def name_of(job: str, iteration: int) -> str:
    """What a signature of checkpoint ``iteration`` of ``job`` is named: it is valid for that one
    checkpoint of that one job, wherever its files are copied."""
    return f"{job}/{layout.iter_dir_name(iteration)}"


def local_name(trust: Trust, directory: Path, manifest) -> str:
    """The name a manifest in ``directory`` must be signed under: the job of the profile that
    names its save directory, and the iteration of the directory itself (not what the manifest
    says of itself, which a manifest copied from another job or iteration would say too)."""
    iteration = layout.parse_iter_dir(Path(directory).name)
    return name_of(trust.job or manifest.job, manifest.iteration if iteration is None else iteration)


def signable(manifest) -> bool:
    """Only cryptographic digests are signed: a signature over XXH3 would vouch for nothing."""
    return manifest.hash_algorithm in CRYPTOGRAPHIC


def signature_for(
    manifest, manifest_bytes: bytes, trust: Trust, where: str, name: str
) -> tuple[bytes, AllowedKey | str]:
    """The signature of a manifest (its exact bytes) under ``name``, and which key signed: its
    entry in ``sign.public_keys``, or its id if the list does not name it. ``where`` names the
    manifest in messages."""
    from model_signing._signing import signing as ms_signing

    if not signable(manifest):
        raise UsageError(
            f"{where}: its files are hashed with {manifest.hash_algorithm}, "
            "which a signature cannot vouch for: set verify.digest to blake3 or sha256"
        )
    statement = _statement(manifest, manifest_bytes, name, where)
    signature = trust.signer().sign(ms_signing.Payload(statement))
    identifier = signature.bundle.verification_material.public_key.hint
    return signature.bundle.to_json().encode(), trust.keys.get(identifier) or short(identifier)


def check_signature(
    data: bytes | None, path: str, where: str, manifest, manifest_bytes: bytes, trust: Trust, name: str
) -> AllowedKey | None:
    """The key that signed this manifest (``where``) under ``name``, if its signature (``data``,
    read from ``path``; None: not there) verifies with an allowed key and its subjects are
    exactly this manifest's; None if unsigned and not required. ``BadSignature`` naming the file
    (and the key) otherwise."""
    from model_signing._signing import sign_ec_key, sign_sigstore_pb
    from sigstore_models.bundle import v1 as bundle_pb

    if data is None:
        if trust.required:
            raise BadSignature(f"{where}: not signed ({SIGNATURE} missing), and sign.required is set")
        return None
    try:
        signature = sign_sigstore_pb.Signature(bundle_pb.Bundle.from_json(data))
        identifier = signature.bundle.verification_material.public_key.hint or ""
    except Exception as e:  # whatever a damaged bundle makes the parser raise
        raise BadSignature(f"{path}: unreadable signature ({type(e).__name__}: {one_line(e)})") from None
    allowed = trust.keys.get(identifier)
    if allowed is None:
        raise BadSignature(
            f"{path}: signed by key {one_line(short(identifier)) or '(none named)'}, not in sign.public_keys"
        )
    if not signable(manifest):
        raise BadSignature(
            f"{where}: files hashed with {manifest.hash_algorithm}, which a signature cannot vouch for"
        )
    try:
        signed = sign_ec_key.Verifier(allowed.path).verify(signature)
    except Exception as e:  # cryptography's InvalidSignature, model signing's ValueErrors
        why = f"{type(e).__name__}: {one_line(e)}" if str(e).strip() else type(e).__name__
        raise BadSignature(f"{path}: does not verify with key {allowed.label()} ({why})") from None
    if signed.model_name != name:
        raise BadSignature(
            f"{path}: signs {one_line(signed.model_name, 120)}, not {name} (key {allowed.label()})"
        )
    _same_subjects(path, signed, _statement(manifest, manifest_bytes, name, where), allowed)
    return allowed


def _same_subjects(path: str, signed, expected, allowed: AllowedKey) -> None:
    have = {d.identifier: d.digest for d in signed.resource_descriptors()}
    want = {d.identifier: d.digest for d in expected.resource_descriptors()}
    for name in sorted(set(want) | set(have)):
        if name not in have:
            problem = "is not among the signed subjects"
        elif name not in want:
            problem = "is signed but not in the manifest"
        elif have[name] != want[name]:
            problem = "differs from its signed digest"
        else:
            continue
        raise BadSignature(f"{path}: {one_line(name, 120)} {problem} (key {allowed.label()})")
