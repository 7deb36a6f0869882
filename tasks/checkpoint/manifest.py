"""The manifest: what a verified checkpoint is, written into it as ``manifest.json``.

The verifier owns this file and is its only writer (``verify.verify_and_record``). Its ``files``
are the reference every later re-verification, copy and restore compares against; they are taken
from the first verification that passed and never replaced afterwards (a failing re-verification
changes ``status`` and
``checks`` but keeps the reference, so the evidence of what the bytes should be survives).

Each manifest written is numbered and recorded in the save directory's verdict log
(``verdicts``): a manifest older than the newest verdict recorded for its checkpoint (one put
back after re-verification found the checkpoint invalid, signed or not) is never trusted. In the
job's own save directory a manifest must also be bound to the log (its sequence there, with its
digest): one that is not (the log deleted or shortened, its line lost) is read as a reference for
the bytes by re-verification only, never as a verdict (``UnboundVerdict``).
"""

import copy
import hashlib
import json
import os
import socket
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pydantic
import pydantic_core

from tasks import __version__
from tasks.checkpoint import layout, signing, verdicts
from tasks.checkpoint.layout import CORE_FILES, MANIFEST
from tasks.checkpoint.signing import Trust
from tasks.checkpoint.state import State
from tasks.errors import CkptopsError, Malformed, unreadable
from tasks.outcome import Check
from tasks.storage.digest import XXH3, Hashing
from tasks.storage.local import atomic_write_together, read_state, stat_files

# 2: checks carry an outcome word (pass, fail) instead of ok: true/false. Version 1 still reads.
# 3: per-tensor statistics (tensors), object families (objects) and the optimizer's step.
SCHEMA_VERSION = 3
READABLE_SCHEMAS = (1, 2, 3)

# No signing policy handed in: signatures are neither checked nor made (a save directory no
# profile speaks for; the caller says so).
UNCHECKED = Trust()


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


class CorruptManifest(Malformed):
    """A manifest that is there but cannot be trusted (does not parse, wrong shape or types)."""


class UntrustedManifest(CorruptManifest):
    """A manifest whose signature the profile's ``sign`` policy does not accept (``signing``)."""


class UnboundVerdict(UntrustedManifest):
    """A manifest of the job's own save directory that the verdict log does not vouch for
    (``verdicts.unbound``): not a verdict to act on, but no evidence of tampering either. Its
    checkpoint is verified again (``catalog``); its file hashes, under its signature, remain the
    reference the bytes are compared with."""


@dataclass
class FileEntry:
    path: str
    size: int
    hash: str


# How the state is shown with what a continuation drill found (``Manifest.resumes``).
RESUME_WORDS = {True: ", certified", False: ", does not resume", None: ""}


@dataclass
class Manifest:
    job: str
    iteration: int
    status: State
    reason: str
    consumed_train_samples: int | None
    writer: dict
    layout: dict
    files: list[FileEntry]
    totals: dict
    checks: list[Check]
    verified_at: str | None
    checked_at: str
    save_identity: dict = field(default_factory=dict)
    verifier: dict = field(default_factory=lambda: {"ckptops": __version__, "host": socket.gethostname()})
    hash_algorithm: str = XXH3  # see tasks.storage.digest; manifests before BLAKE3 have no other
    hash_segment_bytes: int | None = None  # see tasks.storage.digest; None: whole-file hashes
    archive: dict | None = None
    # Schema 3 (None in older manifests: their lineage is not checkable): each tensor's dtype,
    # numel, NaN, Inf, min, max, norm and digest; the object families; the optimizer's step.
    tensors: dict[str, dict] | None = None
    objects: list[str] | None = None
    optimizer_step: int | None = None
    # What the newest continuation drill of this very save found (ok, drill, steps, tolerance,
    # at, detail): ok, it is certified (it resumes as the original run went on); not ok, it loads
    # but does not resume. Kept while re-verification finds the same save valid.
    certification: dict | None = None
    # The data its run trains on (tasks.checkpoint.batches.data_version): the dataset or blend,
    # and the SHA-256s of its train indices in the data cache, so that a resume over other data
    # shows. None in older manifests.
    data_version: dict | None = None
    # Its number among the verdicts recorded for this checkpoint in the save directory's verdict
    # log (``verdicts``); None in a manifest written before the log.
    verdict: int | None = None
    # Its line's sequence in the verdict log, which binds it to the log (``verdicts.unbound``);
    # None in a manifest written before sequences.
    sequence: int | None = None
    # The previous verified checkpoint its lineage was judged against; None: there was none then
    # (it is judged again when one before it is verified: ``verify.rejudge_lineage``).
    lineage_from: int | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def certified(self) -> bool:
        return self.valid and bool(self.certification and self.certification.get("ok"))

    @property
    def resumes(self) -> bool | None:
        """Its newest continuation drill: True, certified; False, it loads but does not resume;
        None, never continued (or not valid)."""
        return self.certified if self.valid and self.certification is not None else None

    @property
    def valid(self) -> bool:
        return self.status is State.VALID

    def same_save(self, files: dict[str, os.stat_result]) -> bool:
        """Whether the checkpoint is still the save this manifest describes.

        Megatron re-saving into the directory rewrites metadata.json and .metadata; a flipped
        bit or a truncation does not. Size and mtime, not the inode, so that a copy made with
        its times kept (a restore) is still recognised as the same save.
        """
        return self.save_identity == save_identity(files)

    @property
    def hashing(self) -> Hashing:
        """How its file hashes were taken."""
        return Hashing(self.hash_algorithm, self.hash_segment_bytes)

    def file_map(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data, where: str) -> "Manifest":
        """A manifest as written (any readable schema), its every field checked for type; a
        ``CorruptManifest`` naming ``where`` and the first field at fault otherwise."""
        if not isinstance(data, dict):
            raise CorruptManifest(f"{where}: not a manifest (a JSON {type(data).__name__}, not an object)")
        if data.get("schema_version") not in READABLE_SCHEMAS:
            raise CorruptManifest(f"{where}: unknown manifest schema {data.get('schema_version')!r}")
        data = dict(data)
        if isinstance(data.get("checks"), list):
            data["checks"] = [Check.from_dict(c) if isinstance(c, dict) else c for c in data["checks"]]
        data["schema_version"] = SCHEMA_VERSION
        try:
            manifest = _MANIFEST.validate_python(data)
        except (pydantic.ValidationError, TypeError) as e:
            raise CorruptManifest(f"{where}: malformed manifest ({_first_error(e)})") from None
        outside = next((f.path for f in manifest.files if not _inside(f.path)), None)
        if outside is not None:
            raise CorruptManifest(
                f"{where}: malformed manifest (file {outside!r} is not inside the checkpoint)"
            )
        return manifest


def _inside(name: str) -> bool:
    """A file's name in a manifest: the checkpoint's own (``__0_0.distcp``) or in one folder of
    it (Megatron-Bridge's ``tokenizer/vocab.json``); never absolute, never up, never empty parts,
    so every copy, download and upload by it stays inside its destination."""
    parts = name.split("/")
    return 0 < len(parts) <= 2 and all(part not in ("", ".", "..") and "\\" not in part for part in parts)


_MANIFEST = pydantic.TypeAdapter(Manifest)


def _first_error(error: Exception) -> str:
    if isinstance(error, pydantic.ValidationError):
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(top level)"
        more = f", and {error.error_count() - 1} more" if error.error_count() > 1 else ""
        return f"{field}: {first['msg']}{more}"
    return str(error)


def save_identity(files: dict[str, os.stat_result]) -> dict:
    """What identifies one save of a checkpoint directory (see ``Manifest.same_save``)."""
    return {name: [files[name].st_size, files[name].st_mtime_ns] for name in CORE_FILES if name in files}


# Manifests parsed in this process, by the BLAKE2 digest of their bytes: at 5,120 files a
# manifest is about 1 MB and takes 15 ms to parse and check, and one promotion reads each kept
# checkpoint's manifest more than once (the catalog, the pointer's last check). A function of
# the bytes alone, so it can never answer for other bytes; callers get their own copy.
_PARSED: "OrderedDict[bytes, Manifest]" = OrderedDict()
_PARSED_KEPT = 16


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """A manifest from its bytes, wherever they were kept (the shared store, the archive):
    ``CorruptManifest`` naming ``where`` if they are not one."""
    digest = hashlib.blake2b(raw, digest_size=32).digest()
    parsed = _PARSED.get(digest)
    if parsed is None:
        try:
            data = pydantic_core.from_json(raw)  # json.loads' result, a third faster at 1 MB
        except ValueError as e:
            raise CorruptManifest(f"{where}: the manifest does not parse ({e})") from None
        parsed = Manifest.from_dict(data, where)
        _PARSED[digest] = parsed
        if len(_PARSED) > _PARSED_KEPT:
            _PARSED.popitem(last=False)
    else:
        _PARSED.move_to_end(digest)
    return copy.copy(parsed)


def check_trusted(
    manifest: Manifest, raw: bytes, signature: bytes | None, kept: tuple[str, str], trust: Trust, name: str
) -> signing.AllowedKey | None:
    """The key that signed ``manifest`` (its bytes ``raw``) under ``name``, checked as ``trust``
    asks, wherever the two were kept (``kept``: where the manifest and where its signature are,
    for messages); None when the policy checks nothing or it is unsigned and may be.
    ``signing.BadSignature`` otherwise."""
    if not trust.checks:
        return None
    where, signature_where = kept
    return signing.check_signature(signature, signature_where, where, manifest, raw, trust, name)


def sign_manifest(
    manifest: Manifest, data: bytes, trust: Trust, where: str, name: str
) -> tuple[bytes | None, str | None]:
    """The signature to keep beside a manifest about to be written (its bytes ``data``) under
    ``name``, and which key made it; (None, None) where the policy does not sign this manifest."""
    if not trust.signs_manifest(manifest):
        return None, None
    signature, key = signing.signature_for(manifest, data, trust, where, name)
    return signature, key.label() if isinstance(key, signing.AllowedKey) else f"key {key}"


def read_manifest(directory: Path, trust: Trust = UNCHECKED) -> Manifest | None:
    """The checkpoint's manifest, or None if it has never been verified (``CorruptManifest`` if
    it cannot be trusted, ``UntrustedManifest`` if its signature is not what ``trust`` asks for,
    ``UnboundVerdict`` if, in the job's own save directory, the verdict log does not vouch for
    it, ``Unreadable`` if the environment refuses to read it)."""
    manifest, _, raw = _read_signed(directory, trust)
    iteration = layout.parse_iter_dir(Path(directory).name)
    if manifest is None or trust.job is None or iteration is None:
        return manifest
    path = Path(directory) / MANIFEST
    why = verdicts.unbound(Path(directory).parent, iteration, manifest.sequence, raw, trust.required)
    if why is not None:
        # Read once more, in case this read fell between a writer's rename and its append.
        if read_state(path) != raw:
            return read_manifest(directory, trust)
        why = verdicts.unbound(Path(directory).parent, iteration, manifest.sequence, raw, trust.required)
        if why is not None:
            raise UnboundVerdict(f"{path}: {why}")
    return manifest


def read_signed_manifest(directory: Path, trust: Trust = UNCHECKED) -> tuple[Manifest | None, str | None]:
    """The checkpoint's manifest as a reference for its bytes (what re-verification compares them
    with), with the allowed key that signed it, for messages (None: unsigned, or a policy that
    checks nothing); ``read_manifest``'s errors, except that one the verdict log does not vouch
    for is returned: its hashes are still under its signature, its verdict is judged again."""
    return _read_signed(directory, trust)[:2]


def _read_signed(directory: Path, trust: Trust) -> tuple[Manifest | None, str | None, bytes | None]:
    """``read_signed_manifest``, with the manifest's exact bytes."""
    path = Path(directory) / MANIFEST
    raw = read_state(path)
    if raw is None:
        return None, None, None
    manifest = parse_manifest(raw, str(path))
    iteration = layout.parse_iter_dir(Path(directory).name)
    if iteration is not None:
        older = verdicts.put_back(Path(directory).parent, iteration, manifest.verdict)
        if older is not None:
            # Read once more, in case this read fell between a writer's rename and its append.
            if read_state(path) != raw:
                return _read_signed(directory, trust)
            raise UntrustedManifest(f"{path}: {older}")
    if not trust.checks:
        return manifest, None, raw
    signature_path = Path(directory) / layout.SIGNATURE
    try:
        signature = read_state(signature_path)
        name = signing.local_name(trust, directory, manifest)
        key = check_trusted(manifest, raw, signature, (str(path), str(signature_path)), trust, name)
    except OSError as e:
        raise UntrustedManifest(f"{signature_path}: unreadable signature ({e.strerror})") from None
    except signing.BadSignature as e:
        # A writer renames the signature and the manifest in turn: read once more, in case this
        # read fell between the two renames.
        if read_state(path) != raw:
            return _read_signed(directory, trust)
        raise UntrustedManifest(str(e)) from None
    return manifest, key.label() if key else None, raw


def valid_for_this_save(directory: Path, iteration: int, trust: Trust = UNCHECKED) -> Manifest | None:
    """The checkpoint's manifest if it says valid for the very save now on disk (the right
    iteration, not a symlinked directory, the same save), else None."""
    directory = Path(directory)
    manifest = read_manifest(directory, trust)
    if (
        manifest is None
        or not manifest.valid
        or manifest.iteration != iteration
        or directory.is_symlink()
        or not manifest.same_save(stat_files(directory, CORE_FILES))
    ):
        return None
    return manifest


def verified_newest_first(
    save_dir: Path, below: int | None = None, trust: Trust = UNCHECKED
) -> Iterator[tuple[int, Manifest]]:
    """The job's checkpoints (those before iteration ``below``, if given) whose manifests say
    valid for the save on disk, newest first, with their manifests; one that cannot be read, or
    was deleted by retention meanwhile, is passed over."""
    save_dir = Path(save_dir)
    try:
        iterations = layout.list_iterations(save_dir)
    except OSError as e:
        raise unreadable(save_dir, e) from None
    for iteration in reversed([i for i in iterations if below is None or i < below]):
        try:
            manifest = valid_for_this_save(save_dir / layout.iter_dir_name(iteration), iteration, trust)
        except (CkptopsError, FileNotFoundError):
            continue  # deleted by retention while we listed, or a manifest not to trust
        if manifest is not None:
            yield iteration, manifest


def _numbers_on_disk(path: Path) -> tuple[int | None, int | None]:
    """The verdict number and the sequence of the manifest a write replaces, read as plainly as
    can be (it may be one that cannot be trusted: its numbers still count)."""
    try:
        found = json.loads(read_state(path) or b"{}")
        numbers = found.get("verdict"), found.get("sequence")
    except (ValueError, AttributeError):
        return None, None
    number, sequence = (n if type(n) is int else None for n in numbers)
    return number, sequence


def write_manifest(directory: Path, manifest: Manifest, trust: Trust) -> str | None:
    """Write the manifest, signed where ``trust`` has a key and its digests are cryptographic
    (``signing``): the signature is made first, so a key that cannot sign changes nothing, and
    the two files are renamed into place together. Which key signed, or None. The manifest gets
    the next verdict number of its checkpoint and the log's next sequence (both under its
    signature), and is recorded in the save directory's verdict log once it is in place: a line
    lost after the rename leaves a manifest the log does not vouch for, which is verified again,
    never trusted on its word (``verdicts.unbound``)."""
    path = Path(directory) / MANIFEST
    save_dir = Path(directory).parent
    if trust.checks and not trust.signs:
        raise signing.CannotSign(
            f"{path}: not written: the profile checks signatures (sign) and this host has no signing key"
        )
    iteration = layout.parse_iter_dir(Path(directory).name)
    if iteration is not None:
        number, sequence = _numbers_on_disk(path)
        manifest.verdict = verdicts.next_number(save_dir, iteration, number)
        manifest.sequence = verdicts.next_sequence(save_dir, sequence)
    data = manifest.to_json().encode()
    name = signing.local_name(trust, directory, manifest)
    signature, key = sign_manifest(manifest, data, trust, str(path), name)
    files = (
        [(path, data)]
        if signature is None
        else [(Path(directory) / layout.SIGNATURE, signature), (path, data)]
    )
    try:
        atomic_write_together(files)
    except OSError as e:
        raise unreadable(path, e) from None
    if iteration is not None:
        verdicts.record(
            save_dir,
            iteration,
            manifest.verdict,
            manifest.sequence,
            manifest.status.value,
            data,
            manifest.checked_at,
        )
    return key
