"""Decide whether a Megatron torch_dist checkpoint is whole, and record the answer in its manifest.

A checkpoint is in one of three states:
- ``in-progress``: still being written (no ``metadata.json`` yet, shards newer than it, an
  expected ``integrity.json`` not there yet, or files changing while we read). Never failed,
  never promoted, no manifest written: the caller waits and asks again.
- ``invalid``: some check failed. The manifest records every check; the first failure, as one
  line naming the file and the check, is the reason.
- ``valid``: every check passed.

The checks, cheapest first: completeness, ``metadata.json``, DCP ``.metadata``, data files
present and long enough with none unreferenced, every chunk and object backed by a record inside
its file, chunks tiling each tensor exactly, object families covering their grids, then one read
of every byte (XXH3-128 per file, CRC-32 per record, SHA-256 where ``integrity.json`` asks for it),
the reference manifest when there is one, and the state Megatron-LM needs to resume.
"""

import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tasks import __version__
from tasks.checkpoint import content as state_content
from tasks.checkpoint import dialect, layout, signing
from tasks.checkpoint.batches import data_version, settled
from tasks.checkpoint.checks import VerifyCheck
from tasks.checkpoint.dcp import (
    CheckFailed,
    DcpIndex,
    build_index,
    collector_off,
    index_limit,
    load_common_state,
    load_dcp_metadata,
    load_object,
)
from tasks.checkpoint.lock import Held
from tasks.checkpoint.manifest import (
    CorruptManifest,
    FileEntry,
    Manifest,
    now_iso,
    read_signed_manifest,
    save_identity,
    valid_for_this_save,
    verified_newest_first,
    write_manifest,
)
from tasks.checkpoint.scan import FileScan, scan_file, scan_files
from tasks.checkpoint.signing import Trust
from tasks.checkpoint.state import State, VerifyOptions, completeness
from tasks.errors import CkptopsError, Malformed, Unreadable, UsageError, unreadable
from tasks.outcome import Check, Outcome, failed, passed
from tasks.storage.bounded import load_json, read_bounded
from tasks.storage.digest import ALGORITHMS, Hashing, comparable
from tasks.storage.local import list_files

_METADATA_JSON_LIMIT = 64 << 10  # metadata.json: a few keys, some tens of bytes


@dataclass
class Verification:
    directory: Path
    iteration: int
    state: State
    reason: str
    checks: list[Check] = field(default_factory=list)
    manifest: Manifest | None = None
    bytes_read: int = 0
    seconds: float = 0.0
    shards: list[dict] = field(default_factory=list)  # the Slurm engine's: which nodes read what
    read_early: list[str] = field(default_factory=list)  # read while the save was still going
    # False when the directory's manifest cannot be trusted: it is kept as evidence, never
    # replaced (a corruption it would have caught could be accepted as the new reference).
    recordable: bool = True
    signed_by: str | None = None  # the key that signed its manifest (signing)
    # Later checkpoints found invalid when their lineage was judged again once this one was
    # found valid (``rejudge_lineage``).
    rejudged: list["Verification"] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.state is State.VALID

    @property
    def throughput_gbps(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def line(self) -> str:
        return f"{self.state.value.upper()} {self.directory.name}: {self.reason}"


class _Checks:
    """Collects check results; the first failure is the checkpoint's one-line reason."""

    def __init__(self):
        self.results: list[Check] = []

    def passed(self, name: VerifyCheck, detail: str) -> None:
        self.results.append(passed(name, detail))

    def fail(self, name: VerifyCheck, file: str | None, detail: str) -> None:
        self.results.append(failed(name, detail, file=file))

    def record(self, failure: CheckFailed) -> None:
        self.fail(failure.check, failure.file, failure.detail)

    def conclude(self, name: VerifyCheck, detail: str) -> None:
        """Record a pass for ``name`` unless a failure under that name was recorded."""
        if not any(r.name == name and not r.ok for r in self.results):
            self.passed(name, detail)

    @property
    def failures(self) -> list[Check]:
        return [r for r in self.results if r.failed]

    def reason(self) -> str:
        """The first failure, where there is one; else the verdict's line (``verdict_reason``)."""
        if not self.failures:
            return verdict_reason(self)
        first = self.failures[0]
        more = len(self.failures) - 1
        where = f"{first.file}: " if first.file else ""
        return f"{where}{first.detail} [{first.name}]" + (f" (+{more} more)" if more else "")


def verdict_reason(checks: _Checks) -> str:
    """The line of a verdict: its first failure; or, where the lineage could not be checked, that
    (a stale re-save of an unverified predecessor passes every other check); or that all passed."""
    if checks.failures:
        return checks.reason()
    unchecked = next(
        (
            c
            for c in checks.results
            if c.name == VerifyCheck.LINEAGE and c.detail.startswith(state_content.LINEAGE_NOT_CHECKED)
        ),
        None,
    )
    if unchecked is not None:
        return f"{unchecked.detail} [{VerifyCheck.LINEAGE}]; every other check passed"
    return "all checks passed"


def _tiles_exactly(size: tuple[int, ...], chunks) -> str | None:
    """None if the chunks cover ``size`` with no gap and no overlap, else what is wrong."""
    total = math.prod(size)
    boxes = []
    for chunk in chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or any(o < 0 or o + s > d for o, s, d in zip(offsets, sizes, size)):
            return f"chunk at {list(offsets)} of size {list(sizes)} lies outside the shape {list(size)}"
        boxes.append((offsets, sizes))
    covered = sum(math.prod(s) for _, s in boxes)
    # Sweep along the dimension the chunks split most: only chunks whose spans meet along it can
    # overlap. Chunks that split one dimension (tensor-parallel shards, experts, flattened
    # optimizer pieces) each meet only their neighbour: n log n; an a x b grid, a x b x min(a, b).
    axis = max(range(len(size)), key=lambda d: len({o[d] for o, _ in boxes}), default=0)
    boxes.sort(key=lambda box: box[0][axis] if size else 0)
    for i, (oa, sa) in enumerate(boxes):
        for j in range(i + 1, len(boxes)):
            ob, sb = boxes[j]
            if size and ob[axis] >= oa[axis] + sa[axis]:
                break
            if all(b < a + la and a < b + lb for a, la, b, lb in zip(oa, sa, ob, sb)):
                return f"chunks at {list(oa)} and {list(ob)} overlap"
    if covered != total:
        return f"chunks cover {covered} of {total} elements (a gap)"
    return None


def _summary(content: state_content.Content, name: VerifyCheck) -> Check | None:
    """A content check that found no failure, as the manifest records it: its first warning,
    why it could not be made, or what passed."""
    warnings = [f.detail for f in content.warnings if f.check == name]
    if warnings:
        more = f" (+{len(warnings) - 1} more)" if len(warnings) > 1 else ""
        return Check(name, Outcome.WARN, warnings[0] + more)
    if name in content.unchecked:
        return Check(name, Outcome.UNCHECKED, content.unchecked[name])
    if name in content.passes:
        return passed(name, content.passes[name])
    return None


def _grid_missing(shards) -> str | None:
    shape = shards[0].shape
    if any(s.shape != shape for s in shards):
        return "shards disagree on the grid shape"
    have = {s.offset for s in shards}
    expected = math.prod(shape)
    if len(have) != expected:
        return f"{len(have)} of {expected} grid cells present"
    if any(any(o >= d for o, d in zip(s.offset, shape)) for s in shards):
        return "a shard lies outside the grid"
    return None


class _Verifier:
    def __init__(
        self,
        directory: Path,
        iteration: int,
        options: VerifyOptions,
        progress,
        reference: Manifest | None = None,
        watch=None,
        prescan=None,
    ):
        self.directory = directory
        self.iteration = iteration
        self.options = options
        self.progress = progress
        self.checks = _Checks()
        self.files = dialect.checkpoint_files(directory, list_files(directory))
        self.args = None  # the run's settings, in Megatron-LM's names (dialect.job_args)
        self.index: DcpIndex | None = None
        self.backend: dict = {}
        self.scans: dict[str, FileScan] = {}
        self.common: dict | None = None
        self.previous: Manifest | None = None  # the newest verified checkpoint before this one
        self.common_file: str | None = None
        self.reference = reference
        self.given_reference = reference is not None
        self.manifest_unreadable = False
        self.reference_signer: str | None = None  # who signed the manifest taken as reference
        self.integrity: dict[str, str] = {}
        self.watch = watch
        self.prescan = prescan
        self.read_early: list[str] = []
        self.shards: list[dict] = []
        self.hashing = options.hashing
        self.stats: dict[str, state_content.TensorStats] | None = None
        self.object_families: list[str] | None = None
        self.step: int | None = None

    def run(self) -> None:
        self._check_metadata_json()
        if not self.given_reference:
            self._load_reference()
        # Against a manifest (signed, where the profile asks), nothing is unpickled from files
        # whose bytes differ from it: .metadata is hashed before it is loaded, the common state
        # and the optimizer's objects only once every file matched.
        if self._metadata_as_referenced():
            self._load_index()
        if self.index is not None:
            self._check_files()
            self._check_records()
            self._check_coverage()
            self._check_objects()
        self._read_integrity_json()
        self._scan_content()
        self._check_integrity_json()
        self._check_against_reference()
        differs = any(c.name == VerifyCheck.MANIFEST for c in self.checks.failures)
        if self.index is not None and not (self.reference is not None and differs):
            self._check_state()
            self._check_content()

    def _metadata_as_referenced(self) -> bool:
        """Whether ``.metadata`` may be loaded: there is no reference, or its bytes are the
        reference's (the reference check then names it if not)."""
        if self.reference is None:
            return True
        entry = self.reference.file_map().get(layout.DCP_METADATA)
        scan = scan_file(self.directory / layout.DCP_METADATA, [], hashing=self.reference.hashing)
        return entry is not None and (scan.size, scan.hash) == (entry.size, entry.hash)

    def _own_json(self, name: str, limit: int, check: VerifyCheck):
        """One of the checkpoint's small JSON files (``bounded``'s policy: a regular file at that
        name, at most ``limit`` bytes, nested at most 64 deep); None, the failure recorded, when
        it is missing or not that."""
        path = self.directory / name
        try:
            data = read_bounded(path, limit, "it", follow=False)
        except Unreadable:
            if os.path.lexists(path):
                raise
            self.checks.fail(check, name, "missing")
            return None
        except (UsageError, Malformed) as e:  # a FIFO, a link, larger than the limit
            self.checks.fail(check, name, str(e).removeprefix(f"{path}: ").removeprefix("it "))
            return None
        try:
            return load_json(data, path, "it")
        except Malformed as e:
            self.checks.fail(check, name, f"unreadable ({str(e).removeprefix(f'{path}: it ')})")
        return None

    def _check_metadata_json(self) -> None:
        name = layout.METADATA_JSON
        config = self._own_json(name, _METADATA_JSON_LIMIT, VerifyCheck.METADATA_JSON)
        if config is None:
            return
        backend = config.get("sharded_backend") if isinstance(config, dict) else None
        if not isinstance(backend, str):
            self.checks.fail(
                VerifyCheck.METADATA_JSON, name, "not a Megatron checkpoint config (no sharded_backend)"
            )
        elif backend not in layout.KNOWN_BACKENDS:
            self.checks.fail(VerifyCheck.METADATA_JSON, name, f"unknown sharded_backend {backend!r}")
        else:
            self.backend = config
            self.checks.passed(
                VerifyCheck.METADATA_JSON, f"{backend} v{config.get('sharded_backend_version')}"
            )

    def _load_reference(self) -> None:
        try:
            manifest, signer = read_signed_manifest(self.directory, self.options.trust)
        except CorruptManifest as e:
            # Kept as evidence: a manifest we cannot read is never replaced by a new one, or a
            # corruption it would have caught could be accepted as the new reference.
            self.manifest_unreadable = True
            self.checks.fail(
                VerifyCheck.MANIFEST,
                layout.MANIFEST,
                f"{str(e).split(': ', 1)[-1]}; move it aside to re-verify from scratch",
            )
            return
        if manifest is not None and manifest.iteration != self.iteration:
            self.manifest_unreadable = True
            self.checks.fail(
                VerifyCheck.MANIFEST,
                layout.MANIFEST,
                f"describes iteration {manifest.iteration}, not {self.iteration}",
            )
            return
        # Only a passing verification of this very save, hashed the way we hash, is a reference
        # for its bytes; after a re-save into the directory the checkpoint is judged afresh.
        if (
            manifest is not None
            and manifest.files
            and manifest.verified_at
            and manifest.hash_algorithm in ALGORITHMS
            and manifest.same_save(self.files)
        ):
            if self._to_be_signed_anew(manifest):
                return
            self.reference, self.reference_signer = manifest, signer

    def _to_be_signed_anew(self, manifest: Manifest) -> bool:
        """A manifest hashed with XXH3 before its job signed manifests: a signature cannot vouch
        for its hashes, so the checkpoint is judged afresh (every check, the profile's digest)
        and its new manifest signed."""
        trust = self.options.trust
        if not trust.signs or signing.signable(manifest) or not self.hashing.cryptographic:
            return False
        self.checks.passed(
            VerifyCheck.MANIFEST,
            f"hashed with {manifest.hash_algorithm} before signing: judged afresh with "
            f"{self.hashing.algorithm}, to be signed",
        )
        return True

    def _load_index(self) -> None:
        try:
            limit = index_limit(self.directory, self.files)
            self.index = build_index(load_dcp_metadata(self.directory / layout.DCP_METADATA, limit))
        except CheckFailed as e:
            self.checks.record(e)
            return
        self.checks.passed(
            VerifyCheck.DCP_METADATA,
            f"{len(self.index.tensors)} tensors, "
            f"{len(self.index.objects)} objects, {len(self.index.records)} records",
        )

    def _check_files(self) -> None:
        referenced = self.index.files
        for name, records in sorted(referenced.items()):
            if name not in self.files:
                self.checks.fail(VerifyCheck.FILES, name, "referenced by .metadata but missing")
                continue
            size, needed = self.files[name].st_size, max(r.end for r in records)
            if size < needed:
                self.checks.fail(VerifyCheck.FILES, name, f"truncated: {size} bytes, records need {needed}")
        for name in sorted(self.files):
            if name.endswith(layout.DATA_SUFFIX) and name not in referenced:
                self.checks.fail(VerifyCheck.FILES, name, "data file not referenced by .metadata")
        self.checks.conclude(VerifyCheck.FILES, f"{len(referenced)} data files present and long enough")

    def _check_records(self) -> None:
        for fqn, item in self.index.tensors.items():
            for chunk in item.chunks:
                if (fqn, tuple(chunk.offsets)) not in self.index.records:
                    self.checks.fail(
                        VerifyCheck.RECORDS,
                        None,
                        f"tensor '{fqn}' chunk at {list(chunk.offsets)} has no record",
                    )
        for fqn in self.index.objects:
            if (fqn, None) not in self.index.records:
                self.checks.fail(VerifyCheck.RECORDS, None, f"object '{fqn}' has no record")
        for name, records in self.index.files.items():
            for record in records:
                if record.offset < 0 or record.length <= 0:
                    self.checks.fail(
                        VerifyCheck.RECORDS,
                        name,
                        f"record '{record.key}' has offset {record.offset}, length {record.length}",
                    )
            for before, after in zip(records, records[1:]):
                if after.offset < before.end:
                    self.checks.fail(
                        VerifyCheck.RECORDS, name, f"records '{before.key}' and '{after.key}' overlap"
                    )
        self.checks.conclude(VerifyCheck.RECORDS, "every chunk and object has its own record")

    def _check_coverage(self) -> None:
        for fqn, item in sorted(self.index.tensors.items()):
            problem = _tiles_exactly(tuple(item.size), item.chunks)
            if problem:
                self.checks.fail(VerifyCheck.COVERAGE, layout.DCP_METADATA, f"tensor '{fqn}': {problem}")
        self.checks.conclude(VerifyCheck.COVERAGE, f"{len(self.index.tensors)} tensors tiled exactly")

    def _check_objects(self) -> None:
        families: dict[str, list] = {}
        for shard in self.index.object_shards():
            families.setdefault(shard.family, []).append(shard)
        for family, shards in sorted(families.items()):
            problem = _grid_missing(shards)
            if problem:
                self.checks.fail(
                    VerifyCheck.OBJECTS, layout.DCP_METADATA, f"object family '{family}': {problem}"
                )
        self.checks.conclude(
            VerifyCheck.OBJECTS, f"{len(families)} sharded-object families cover their grids"
        )

    def _read_integrity_json(self) -> None:
        name = layout.INTEGRITY_JSON
        if name not in self.files:
            return
        # It lists the top-level files: a name and a digest each, some hundred bytes.
        limit = _METADATA_JSON_LIMIT + 400 * len(self.files)
        data = self._own_json(name, limit, VerifyCheck.INTEGRITY_JSON)
        if data is None:
            return
        try:
            if data.get("algorithm", "sha256") != "sha256":
                raise ValueError(f"algorithm {data.get('algorithm')!r} is not sha256")
            # Megatron hashes every top-level file when it finalises; if we verified before it
            # did, it lists our own manifest too, which says nothing about the checkpoint.
            self.integrity = {
                str(k): str(v) for k, v in data["files"].items() if not layout.is_own_file(str(k))
            }
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            self.checks.fail(VerifyCheck.INTEGRITY_JSON, name, f"unreadable ({e})")

    def _scan_content(self) -> None:
        referenced = self.index.files if self.index is not None else {}
        present = sorted(name for name in self.files if not layout.is_own_file(name))
        # A record with no place in any file fails the records check; there is nothing to read.
        files = {
            name: [r for r in referenced.get(name, []) if r.offset >= 0 and r.length > 0] for name in present
        }
        # Hashes are compared with the reference's, taken the way it took them (its algorithm, an
        # older manifest's whole-file hashes, or another segment size), whatever the profile says now.
        if self.reference is not None:
            reference = self.reference
            segment = self.hashing.segment_bytes
            if not comparable(reference.hash_segment_bytes, segment, [f.size for f in reference.files]):
                segment = reference.hash_segment_bytes
            self.hashing = Hashing(reference.hash_algorithm, segment)
        early = {}
        if self.prescan is not None and self.hashing == self.prescan.hashing:
            early = {n: s for n in files if (s := self.prescan.reuse(n, files[n])) is not None}
            # integrity.json lists SHA-256s: an early reading counts only if it took one too.
            early = {n: s for n, s in early.items() if n not in self.integrity or s.sha256}
            self.read_early = sorted(early)
        rest = {n: records for n, records in files.items() if n not in early}
        self.scans = early | self._read(rest, set(self.integrity) & set(present))
        for name, scan in sorted(self.scans.items()):
            if scan.unreadable is not None:
                raise unreadable(self.directory / name, scan.unreadable)
            for failure in scan.failures:
                self.checks.fail(VerifyCheck.CRC, name, failure)
        records = sum(s.records for s in self.scans.values())
        self.checks.conclude(VerifyCheck.CRC, f"{records} records' CRCs match")

    def _read(self, files: dict, sha256_for: set[str]) -> dict[str, FileScan]:
        """Every byte read once: by this host's threads, or by shard tasks on Slurm nodes."""
        if self.options.engine != "slurm":
            return scan_files(
                self.directory, files, sha256_for, self.options.threads, self.progress, self.hashing
            )
        from tasks.checkpoint.slurm_engine import SlurmEngine

        engine = SlurmEngine(self.options.slurm, self.progress, self.watch)
        try:
            return engine.scan(self.directory, files, sha256_for, self.hashing)
        finally:
            self.shards = [s.row() for s in engine.statuses]

    def _check_integrity_json(self) -> None:
        if not self.integrity:
            return
        for name, expected in sorted(self.integrity.items()):
            scan = self.scans.get(name)
            if scan is None:
                self.checks.fail(VerifyCheck.INTEGRITY_JSON, name, "listed in integrity.json but missing")
            elif scan.sha256 != expected:
                self.checks.fail(VerifyCheck.INTEGRITY_JSON, name, "sha256 differs from integrity.json")
        self.checks.conclude(VerifyCheck.INTEGRITY_JSON, f"{len(self.integrity)} files match")

    def _check_against_reference(self) -> None:
        if self.reference is None:
            return
        expected = self.reference.file_map()
        for name, entry in sorted(expected.items()):
            scan = self.scans.get(name)
            if scan is None:
                self.checks.fail(VerifyCheck.MANIFEST, name, "in the manifest but missing")
            elif scan.size != entry.size:
                self.checks.fail(VerifyCheck.MANIFEST, name, f"size {scan.size}, manifest says {entry.size}")
            elif scan.hash != entry.hash:
                self.checks.fail(
                    VerifyCheck.MANIFEST,
                    name,
                    f"content differs from the manifest ({self.hashing.algorithm})",
                )
        # A data file the save did not have is an error; a file added later by a finalize step
        # (integrity.json, a tokenizer) is not part of what was verified, and is only noted.
        added = sorted(set(self.scans) - set(expected))
        for name in added:
            if layout.is_checkpoint_content(name):
                self.checks.fail(VerifyCheck.MANIFEST, name, "not in the manifest")
        later = [n for n in added if not layout.is_checkpoint_content(n)]
        note = f" ({', '.join(later)} added since)" if later else ""
        self.checks.conclude(VerifyCheck.MANIFEST, f"{len(expected)} files match the manifest{note}")

    def _check_state(self) -> None:
        record = self.index.records.get(("common_state/shard_0_1", None))
        self.common_file = record.file if record else "common.pt"
        try:
            self.common = load_common_state(self.directory, self.index)
        except CheckFailed as e:
            self.checks.record(e)
            return
        try:
            args = self.args = dialect.job_args(self.directory, self.common, self.index)
        except (OSError, ValueError, KeyError, TypeError, CkptopsError):
            args = None  # a Bridge file that cannot be read: its own finding names it
        # The dialect's own rules first: a Bridge file missing is the cause of whatever follows.
        previous = self.previous = None if self.given_reference else self._previous()
        before = (previous.iteration, previous.consumed_train_samples) if previous else None
        findings = dialect.findings(
            self.directory,
            self.iteration,
            args,
            self._data_parallel(),
            before if before and None not in before else None,
        )
        for finding in findings:
            self.checks.fail(finding.check, finding.file, finding.detail)
        self._check_required(args, named=bool(findings))
        stored = self.common.get("iteration")
        if stored != self.iteration:
            self.checks.fail(
                VerifyCheck.ITERATION,
                self.common_file,
                f"common state says iteration {stored}, the directory {self.iteration}",
            )
        else:
            self.checks.passed(VerifyCheck.ITERATION, f"iteration {stored} matches the directory")
        self._check_layout(args)

    def _check_required(self, args, named: bool) -> None:
        """Model, optimizer, scheduler, RNG and the run's settings; ``named``: the dialect's
        findings already named why its settings could not be read."""
        missing = [k for k in ("iteration", "opt_param_scheduler") if k not in self.common]
        if args is None and not named:
            missing.append("args")
        elif args is not None and getattr(args, "consumed_train_samples", None) is None:
            missing.append("args.consumed_train_samples")
        keys = list(self.index.tensors) + list(self.index.objects)
        if not any(
            not k.startswith(("optimizer.", "rng_state/", "common_state/")) for k in self.index.tensors
        ):
            missing.append("model tensors")
        if not getattr(args, "no_save_optim", False) and not any(k.startswith("optimizer.") for k in keys):
            missing.append("optimizer state")
        if not getattr(args, "no_save_rng", False) and not any(k.startswith("rng_state/") for k in keys):
            missing.append("rng_state")
        if missing:
            self.checks.fail(
                VerifyCheck.STATE, self.common_file, f"required state missing: {', '.join(missing)}"
            )
        elif not named:
            self.checks.passed(VerifyCheck.STATE, "model, optimizer, scheduler, RNG and common state present")

    def _data_parallel(self) -> int | None:
        return self.options.layout[2] if self.options.layout else None

    def _check_content(self) -> None:
        """The values in the tensors, the optimizer's invariants and the lineage (``content``)."""
        found = {(name, v.offset): v for name, scan in self.scans.items() for v in scan.values}
        content = state_content.Content()
        read = {name for name, scan in self.scans.items() if scan.hash is not None and not scan.failures}
        self.stats = state_content.tensor_stats(self.index, found, read, content)
        families = {s.family for s in self.index.object_shards()}
        self.object_families = sorted(families | {k for k in self.index.objects if "/shard_" not in k})
        if self.common is not None:
            args = self.args
            previous = self.previous  # the newest verified checkpoint before (_check_state)
            steps = state_content.step_counters(self.common, self._optimizer_objects(), self.stats)
            self.step = state_content.check_optimizer(content, self.iteration, args, steps, previous)
            frozen = list(self.options.frozen)
            objects = set(self.object_families)
            state_content.check_claims(content, self.index, objects, self.common, args, frozen, self.step)
            if not self.given_reference:
                earlier = None if previous is not None else self._earlier()
                state_content.check_lineage(
                    content, self.stats, objects, previous, frozen, self.options.drift_factor, earlier
                )
        for finding in content.failures:
            self.checks.fail(finding.check, finding.file, finding.detail)
        for name in (VerifyCheck.VALUES, VerifyCheck.OPTIMIZER, VerifyCheck.LINEAGE):
            summary = _summary(content, name)
            if summary is not None and not any(r.name == name for r in self.checks.failures):
                self.checks.results.append(summary)

    def _optimizer_objects(self) -> dict:
        """The distributed optimizer's per-group param groups (dp_reshardable saves them as
        sharded objects), loaded safely; one that cannot be loaded fails the state check."""
        found = {}
        for key in state_content.group_optimizer_objects(self.index):
            try:
                found[key] = load_object(self.directory, self.index, key)
            except CheckFailed as e:
                self.checks.record(e)
        return found

    def _previous(self) -> Manifest | None:
        """The newest verified checkpoint of the job before this one: its manifest, valid for
        the save on disk (one that cannot be read, or describes an older save, is passed over)."""
        found = next(verified_newest_first(self.directory.parent, self.iteration, self.options.trust), None)
        return found[1] if found else None

    def _earlier(self) -> int | None:
        """The newest checkpoint directory of the job before this one, verified or not."""
        return max(
            (i for i in layout.list_iterations(self.directory.parent) if i < self.iteration), default=None
        )

    def _check_layout(self, args) -> None:
        stored = self._layout(args)
        found = (stored["tensor_parallel"], stored["pipeline_parallel"], stored["data_parallel"])
        if self.options.layout is None or None in found:
            return
        if found != self.options.layout:
            self.checks.fail(
                VerifyCheck.LAYOUT,
                self.common_file,
                f"saved with TP/PP/DP {found}, the profile says {self.options.layout}",
            )
        else:
            self.checks.passed(VerifyCheck.LAYOUT, f"TP/PP/DP {found} as the profile says")

    def changed_files(self) -> list[str]:
        return sorted(name for name, scan in self.scans.items() if scan.changed)

    def manifest(self) -> Manifest:
        args = self.args
        content = (self.common or {}).get("content_metadata") or {}
        failures = self.checks.failures
        observed = [FileEntry(name, s.size, s.hash or "") for name, s in sorted(self.scans.items())]
        valid = not failures
        reference = self.reference
        checked_at = now_iso()
        return Manifest(
            job=self.options.job,
            iteration=self.iteration,
            status=State.VALID if valid else State.INVALID,
            reason=verdict_reason(self.checks),
            consumed_train_samples=getattr(args, "consumed_train_samples", None),
            writer=self._writer(content),
            layout=self._layout(args),
            files=reference.files if reference else observed,
            totals={
                "files": len(observed),
                "bytes": sum(f.size for f in observed),
                "tensors": len(self.index.tensors) if self.index else 0,
                "objects": len(self.index.objects) if self.index else 0,
                "records": len(self.index.records) if self.index else 0,
            },
            checks=self.checks.results,
            verified_at=reference.verified_at if reference else (checked_at if valid else None),
            checked_at=checked_at,
            save_identity=reference.save_identity if reference else save_identity(self.files),
            hash_algorithm=reference.hash_algorithm if reference else self.hashing.algorithm,
            hash_segment_bytes=reference.hash_segment_bytes if reference else self.hashing.segment_bytes,
            verifier=self._verifier(),
            tensors={k: asdict(v) for k, v in self.stats.items()} if self.stats is not None else None,
            objects=self.object_families,
            optimizer_step=self.step,
            certification=reference.certification if reference and valid else None,
            data_version=self._data_version(args, reference),
            lineage_from=self.previous.iteration if self.previous is not None else None,
        )

    def _data_version(self, args, reference: Manifest | None) -> dict | None:
        """The data the run trains on (``batches.data_version``): the reference's, unless its
        indices could not be read then (read again for the checkpoint's own manifest); the index
        files' digests of the checkpoint before, where the files are unchanged, are not computed
        again."""
        if reference is not None and (self.given_reference or settled(reference.data_version)):
            return reference.data_version
        if args is None:
            return None
        known = self.previous.data_version if self.previous else None
        return data_version(args, self.directory, known)

    def _verifier(self) -> dict:
        """Who read the bytes: this host, or which nodes read which shard."""
        found = {"ckptops": __version__, "host": socket.gethostname(), "engine": self.options.engine}
        if self.shards:
            found["shards"] = [
                {"shard": row["shard"], "MB": row["MB"], "nodes": row["nodes"], "seconds": row["seconds"]}
                for row in self.shards
            ]
        return found

    def _writer(self, content: dict) -> dict:
        recorded = content.get("megatron_core_version")
        return {
            "megatron_core": recorded or self.options.megatron_core_version,
            "megatron_core_source": "checkpoint"
            if recorded
            else ("profile" if self.options.megatron_core_version else "unknown"),
            "torch": content.get("torch_version"),
            "sharded_backend": self.backend.get("sharded_backend"),
            "sharded_backend_version": self.backend.get("sharded_backend_version"),
            "dcp_metadata_version": getattr(self.index.metadata, "version", None) if self.index else None,
            "checkpoint_version": (self.common or {}).get("checkpoint_version"),
        }

    @staticmethod
    def _layout(args) -> dict:
        get = lambda name: getattr(args, name, None)  # noqa: E731
        return {
            "tensor_parallel": get("tensor_model_parallel_size"),
            "pipeline_parallel": get("pipeline_model_parallel_size"),
            "data_parallel": get("data_parallel_size"),
            "world_size": get("world_size"),
        }


def checkpoint_path(directory: Path) -> Path:
    """The checkpoint directory with its parents resolved but not itself: a symlinked
    ``iter_*`` is refused, never followed to some other iteration's data."""
    directory = Path(directory)
    path = directory.parent.resolve() / directory.name
    if layout.parse_iter_dir(path.name) is None:
        raise UsageError(f"{directory}: not a checkpoint directory (expected iter_NNNNNNN)")
    if path.is_symlink():
        raise UsageError(f"{directory}: is a symlink; verify the directory it points to")
    if not path.is_dir():
        raise UsageError(f"{directory}: no such checkpoint directory")
    return path


def verify_checkpoint(
    directory: Path,
    options: VerifyOptions,
    progress: Callable[[int], None] | None = None,
    reference: Manifest | None = None,
    watch: Callable | None = None,
    prescan=None,
) -> Verification:
    """Verify one checkpoint directory; ``verify_and_record`` records the verdict.

    ``reference`` compares the bytes with a given manifest instead of the directory's own: a
    restored copy is checked against the manifest of what was archived or copied. ``watch``
    follows the Slurm engine's shards (``slurm_engine.Watch``). ``prescan`` holds data files read
    while the save was still going (``prescan.Prescan``), taken where still exactly what was read.
    Raises Unreadable (and writes nothing) when the environment keeps us from reading it.
    """
    import torch  # noqa: F401  (the readers import it on first use: here, before the clock starts)

    # A million records' index is a million live objects, and every collection walked them all
    # again (a listing of 5,120 files took 0.9 s instead of 30 ms): none is garbage (dcp).
    with collector_off():
        return _verify(directory, options, progress, reference, watch, prescan)


def _verify(directory, options, progress, reference, watch, prescan) -> Verification:
    directory = checkpoint_path(directory)
    iteration = layout.parse_iter_dir(directory.name)
    started = time.monotonic()
    before = completeness(directory, options)
    if before.state is State.IN_PROGRESS:
        return Verification(directory, iteration, before.state, before.reason)
    verifier = _Verifier(directory, iteration, options, progress, reference, watch, prescan)
    if before.state is State.INVALID:
        verifier.checks.fail(VerifyCheck.COMPLETE, before.file, before.detail)
    else:
        verifier.run()
    bytes_read = sum(s.size for s in verifier.scans.values())
    seconds = time.monotonic() - started
    changed = verifier.changed_files()
    after = completeness(directory, options)
    if changed or after.state is State.IN_PROGRESS:
        # Whatever we read is void: the writer is still at work.
        reason = f"{changed[0]}: changed while being read" if changed else after.reason
        return Verification(
            directory,
            iteration,
            State.IN_PROGRESS,
            reason,
            verifier.checks.results,
            bytes_read=bytes_read,
            seconds=seconds,
            shards=verifier.shards,
            read_early=verifier.read_early,
        )
    manifest = verifier.manifest()
    return Verification(
        directory,
        iteration,
        manifest.status,
        manifest.reason,
        manifest.checks,
        manifest,
        bytes_read,
        seconds,
        verifier.shards,
        verifier.read_early,
        recordable=not verifier.manifest_unreadable,
        # Who signed the manifest it was checked against (verify_and_record: the one it writes).
        signed_by=verifier.reference_signer,
    )


def verify_and_record(
    directory: Path,
    options: VerifyOptions,
    held: Held,
    progress: Callable[[int], None] | None = None,
    watch: Callable | None = None,
    prescan=None,
) -> Verification:
    """Verify a checkpoint of the job and record the verdict in its manifest (manifests are
    written here and by ``record_certification`` only, both through ``write_manifest``).
    ``held``: its save directory's job lock, which promotion re-reads manifests under and
    retention deletes under. A checkpoint still in progress, or one whose manifest cannot be
    trusted, gets no new manifest."""
    if not held.covers(directory):
        raise CkptopsError(f"{directory}: recording its manifest needs its save directory's job lock")
    result = verify_checkpoint(directory, options, progress, watch=watch, prescan=prescan)
    if result.manifest is not None and result.recordable:
        result.signed_by = write_manifest(result.directory, result.manifest, options.trust)
        if result.ok:
            result.rejudged = rejudge_lineage(result.directory, result.manifest, options)
    return result


def rejudge_lineage(directory: Path, verified: Manifest, options: VerifyOptions) -> list[Verification]:
    """Judge again the lineage of the later checkpoints that were verified before this one
    (``verified``, its manifest, just recorded valid): one verified while this one was not yet
    had no predecessor, or an older one, to be compared with, so a stale re-save of this very
    checkpoint was found valid. Each later valid checkpoint whose lineage was judged against
    none, or against an older one than the newest valid before it, is judged against that one
    from the two manifests' tensor statistics (no byte is read again); one that is a stale
    re-save, or lost a tensor or an object family, gets a manifest that says invalid, and is
    returned. One still valid is left as written (its manifest is not rewritten for a lineage
    that holds). Stops at the first whose lineage was judged against the newest valid before
    it. The caller holds the job lock. The step counter's continuity is not judged again (it
    needs the job's arguments, which the manifest does not keep): a full re-verification does."""
    save_dir = Path(directory).parent
    previous, voided, invalid = verified, set(), []
    for later in [i for i in layout.list_iterations(save_dir) if i > verified.iteration]:
        target = save_dir / layout.iter_dir_name(later)
        try:
            manifest = valid_for_this_save(target, later, options.trust)
        except (CkptopsError, FileNotFoundError):
            continue  # not to be trusted, or deleted meanwhile: not a valid one to judge
        if manifest is None:
            continue
        basis = manifest.lineage_from
        judged = basis is not None and basis >= previous.iteration and basis not in voided
        if judged or not manifest.tensors:
            break
        result = _rejudged(target, manifest, previous, options)
        if result is None:
            break
        if result.ok:
            if result.reason != manifest.reason:  # it said its lineage was not checked
                write_manifest(target, result.manifest, options.trust)
            previous = manifest
            continue
        write_manifest(target, result.manifest, options.trust)
        invalid.append(result)
        voided.add(later)
    return invalid


def _rejudged(
    directory: Path, manifest: Manifest, previous: Manifest, options: VerifyOptions
) -> Verification | None:
    """The lineage of ``manifest``'s checkpoint against ``previous``, from their manifests, as a
    verification with the manifest to write; None if its tensor statistics are not as written."""
    try:
        stats = {name: state_content.TensorStats(**values) for name, values in manifest.tensors.items()}
    except TypeError:
        return None
    content = state_content.Content()
    objects = set(manifest.objects or [])
    frozen = list(options.frozen)
    state_content.check_lineage(content, stats, objects, previous, frozen, options.drift_factor)
    found = [failed(VerifyCheck.LINEAGE, f.detail, file=f.file) for f in content.failures]
    summary = _summary(content, VerifyCheck.LINEAGE)
    found = found or ([summary] if summary is not None else [])
    checks = [c for c in manifest.checks if c.name != VerifyCheck.LINEAGE]
    at = next((i for i, c in enumerate(manifest.checks) if c.name == VerifyCheck.LINEAGE), len(checks))
    checks[at:at] = found
    judged = _Checks()
    judged.results = checks
    valid = not judged.failures
    rewritten = replace(
        manifest,
        status=State.VALID if valid else State.INVALID,
        reason=judged.reason(),
        checks=checks,
        checked_at=now_iso(),
        tensors={name: asdict(s) for name, s in stats.items()},
        lineage_from=previous.iteration,
        certification=manifest.certification if valid else None,
    )
    return Verification(directory, manifest.iteration, rewritten.status, rewritten.reason, checks, rewritten)


def record_certification(
    directory: Path, files: list[FileEntry], record: dict, held: Held, trust: Trust
) -> bool:
    """Record what a continuation drill of this checkpoint found, in its manifest, if the manifest
    is valid for the save on disk and lists the very files the drill restored (``files``, the
    drilled manifest's): False, and nothing written, otherwise. ``trust``: the job's signing
    policy, which the manifest is read and written under."""
    if not held.covers(directory):
        raise CkptopsError(f"{directory}: recording its manifest needs its save directory's job lock")
    iteration = layout.parse_iter_dir(Path(directory).name)
    manifest = valid_for_this_save(directory, iteration, trust) if iteration is not None else None
    if manifest is None or manifest.file_map() != {f.path: f for f in files}:
        return False
    manifest.certification = record
    try:
        write_manifest(directory, manifest, trust)
    except signing.CannotSign:
        return False  # the drill's result stands in its history; the manifest stays as signed
    return True


def verify_with_profile(
    profile,
    directory: Path,
    read_only: bool = False,
    engine: str | None = None,
    nodes: int | None = None,
    progress: Callable[[int], None] | None = None,
    watch: Callable | None = None,
) -> Verification:
    """One checkpoint verified as ``ckptops verify`` does: with the profile's settings (``engine``
    and ``nodes`` instead of its engine's, if given) and, unless ``read_only``, the verdict
    recorded under the job lock (a promotion re-reads manifests under it, and retention may be
    removing this very directory)."""
    if engine not in (None, "local", "slurm"):
        raise UsageError(f"--engine {engine}: not local or slurm")
    directory = checkpoint_path(directory)
    slurm = profile.verify.slurm
    options = VerifyOptions.from_profile(
        profile,
        directory.parent,
        engine=engine or profile.verify.engine,
        slurm=slurm.model_copy(update={"nodes": nodes}) if nodes else slurm,
    )
    if read_only:
        return verify_checkpoint(directory, options, progress, watch=watch)
    from tasks.checkpoint.promote import Here, recording  # promote builds on this module

    with recording(directory.parent, profile.verify.lock_timeout_seconds, Here(progress, watch)) as recorder:
        return recorder.verify(layout.parse_iter_dir(directory.name), options)
