"""Profiles: one YAML per cluster or job, validated by one schema.

``profiles/local.yaml`` is the embedded default. Relative paths in a profile are relative to the
profile file, so a profile and the data it names can move together: every path field is a
``ProfilePath``, which validation resolves against the folder ``load_profile`` passes in the
validation context (a profile built in code, without one, keeps its paths as given). Unknown keys
are errors (a misspelt ``keep_verfied`` must not silently fall back to a default), and so is a key
given twice (YAML keeps the last without a word); every error names the file and the key. A
profile is not always ckptops's own file: it is read as every such file is
(``tasks.storage.bounded``: a regular file, its size and nesting bounded).
"""

import codecs
import importlib.resources
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tasks.errors import Malformed, UsageError
from tasks.health.checks.conformance import Fact
from tasks.health.verdict import CheckName, NodeCheck
from tasks.health.xids import CRITICAL_XIDS
from tasks.recovery.triage.model import FailureClass
from tasks.storage.bounded import load_yaml, read_bounded
from tasks.storage.digest import CRYPTOGRAPHIC, PROFILE_NAMES

# The shipped profiles: package data, found the same way installed or in a checkout.
PROFILES_DIR = Path(str(importlib.resources.files("profiles")))
DEFAULT_PROFILE = "local"
PROFILES_ENV = "CKPTOPS_PROFILES"

# A profile is a page of settings (the 500B example is 6 kB): a file past this is not one.
MAX_PROFILE_BYTES = 1 << 20

SLUG_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
Slug = Annotated[str, Field(pattern=SLUG_PATTERN)]
Positive = Annotated[float, Field(gt=0)]


def _in_profile_folder(path: Path, info: ValidationInfo) -> Path:
    """A relative path is the profile folder's: the validation context's ``base``, when there is one."""
    base = info.context.get("base") if info.context else None
    return path if base is None or path.is_absolute() else (Path(base) / path).resolve()


ProfilePath = Annotated[Path, AfterValidator(_in_profile_folder)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Layout(_Section):
    """The job's parallel layout; the world size is their product."""

    tensor_parallel: Annotated[int, Field(ge=1)] = 1
    pipeline_parallel: Annotated[int, Field(ge=1)] = 1
    data_parallel: Annotated[int, Field(ge=1)] = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel


class Job(_Section):
    name: Slug
    save_dir: ProfilePath
    megatron_core_version: str | None = Field(
        default=None,
        description="the version the job pins; recorded in manifests of checkpoints that do not "
        "carry their writer's version themselves",
    )
    layout: Layout = Layout()
    writes_integrity_json: bool = Field(
        default=False,
        description="the job saves with --verify-integrity: a checkpoint without integrity.json "
        "is then still being finalised",
    )
    user: str | None = Field(
        default=None,
        description="the user the job runs as (a name or a uid): a save directory, checkpoint, "
        "manifest or pointer owned by another user (but root or ckptops' own) is not promoted; "
        "default: the owner of the save directory",
    )


class SlurmVerify(_Section):
    """The Slurm engine: one checkpoint's bytes spread over nodes, one shard per task."""

    partition: str | None = Field(default=None, description="default: the cluster's default partition")
    nodes: Annotated[int, Field(ge=1)] = 1
    ntasks_per_node: Annotated[int, Field(ge=1)] = Field(
        default=1, description="shards verified at once per node (each task uses every thread it is given)"
    )
    time_limit: str = Field(default="00:30:00", pattern=r"^(\d+-)?(\d+:)?\d+(:\d+)?$")
    account: str | None = None
    python: str | None = Field(
        default=None,
        description="the interpreter with ckptops installed on the nodes; default: the one verifying",
    )
    work_dir: ProfilePath | None = Field(
        default=None,
        description="where the shard plan and results go, on storage every node sees; "
        "default: .ckptops-verify in the save directory",
    )
    max_read_mbps: Positive | None = Field(
        default=None, description="cap each task's read rate (MB/s), to spare a file system training is using"
    )
    drop_cache: bool = Field(
        default=True,
        description="each task drops its node's cached pages of what it reads first, so the bytes "
        "come from the storage and not from memory a writer on that node left behind",
    )
    straggler_factor: Annotated[float, Field(gt=1)] = Field(
        default=3.0, description="a shard running this many times the median shard time is retried elsewhere"
    )
    straggler_min_seconds: Annotated[float, Field(ge=0)] = 60
    srun_args: list[str] = Field(
        default_factory=list, description="more srun options (a container image, ...)"
    )


class Verify(_Section):
    threads: Annotated[int, Field(ge=0)] = Field(
        default=0, description="files hashed in parallel; 0 means one per CPU core"
    )
    engine: Literal["local", "slurm"] = Field(
        default="local", description="local: this host reads every byte; slurm: shards over nodes with srun"
    )
    slurm: SlurmVerify = SlurmVerify()
    overlap_save: bool = Field(
        default=False,
        description="while waiting for a save (--async-save), read each data file once it has "
        "settled; the verdict then comes seconds after the last file (local engine)",
    )
    digest: Literal[tuple(PROFILE_NAMES)] = Field(
        default="xxh3",
        description="each file's hash in new manifests: xxh3 finds accidents; blake3 and sha256 are "
        "cryptographic (what a signed manifest needs), read in the same pass as the CRCs",
    )
    segment_mb: Annotated[int, Field(ge=1)] = Field(
        default=1024,
        description="files are hashed in segments of this size: the unit the Slurm engine splits files by",
    )
    abandon_after_seconds: Positive = Field(
        default=6 * 3600,
        description="a checkpoint without metadata.json whose files have not changed for this "
        "long will never finish: it is reported invalid instead of in progress",
    )
    settle_seconds: Annotated[float, Field(ge=0)] = Field(
        default=30,
        description="metadata.json or integrity.json that does not parse and changed more recently "
        "than this may still be being written (Megatron writes them non-atomically); with "
        "overlap_save, a data file is read early once unchanged for this long",
    )
    frozen: list[str] = Field(
        default_factory=list,
        description="name patterns (fnmatch) of parameters meant to stay frozen: exempt from the "
        "stale re-save check and from needing optimizer state",
    )
    drift_factor: Annotated[float, Field(gt=1)] = Field(
        default=10,
        description="a weight whose L2 norm moved by more than this factor since the previous "
        "verified checkpoint is a warning (a loss spike often starts there)",
    )
    allow_group_write: bool = Field(
        default=False,
        description="trust a group-writable save directory, checkpoint, manifest or pointer (a "
        "shared project group); world-writable ones are never promoted",
    )
    wait_timeout_seconds: Annotated[float, Field(ge=0)] = 900
    poll_seconds: Positive = 10
    lock_timeout_seconds: Annotated[float, Field(ge=0)] = 600
    alert_after_seconds: Annotated[float, Field(ge=10)] | None = Field(
        default=None,
        description="the newest complete checkpoint unpromoted this long raises the alarm (status, "
        "and a notification through notify.block); default: twice the save interval the saves show, "
        "at least 300 s",
    )

    save_stall_seconds: Positive | None = Field(
        default=None,
        description="a save that writes no byte (or, by the job's log, runs) this long is stalled: "
        "the alarm names it; default: save_stall_factor times the p99 of the job's own measured "
        "saves (at least 60 s), 1800 s until three saves are measured",
    )
    save_stall_factor: Annotated[float, Field(gt=1)] = Field(
        default=5, description="the p99 save time a save may take this many times over before it is stalled"
    )
    space_margin_gb: Annotated[float, Field(ge=0)] = Field(
        default=0,
        description="after each promotion the store must hold the next save (the newest checkpoint's "
        "size), the archive's copy where it is written to the same file system, and this much more; "
        "less raises the alarm before the next save fails",
    )

    @model_validator(mode="after")
    def _overlap_reads_here(self):
        if self.overlap_save and self.engine == "slurm":
            raise ValueError("overlap_save reads on the verifying host: it needs engine local")
        return self


class Sign(_Section):
    """Signed manifests (tasks/checkpoint/signing.py): who may vouch for a checkpoint's bytes."""

    key_file: ProfilePath | None = Field(
        default=None,
        description="an elliptic-curve private key (PEM; P-256, P-384 or P-521), readable by its "
        "owner only: every manifest written is signed with it",
    )
    key_secret: str | None = Field(
        default=None, description="a Prefect Secret block holding that private key instead of a file"
    )
    public_keys: list[ProfilePath] = Field(
        default_factory=list,
        description="the public keys (PEM) that may sign; a manifest signed by another key is untrusted",
    )
    required: bool = Field(
        default=False,
        description="an unsigned manifest, or one signed by a key not listed, is untrusted: never "
        "promoted, copied, drilled or resumed from",
    )

    @model_validator(mode="after")
    def _coherent(self):
        if self.key_file is not None and self.key_secret is not None:
            raise ValueError("key_file and key_secret: name one place for the key, not both")
        if (self.required or self.key_file or self.key_secret) and not self.public_keys:
            raise ValueError(
                "public_keys: name the keys that may sign (the signer's own among them): "
                "signatures nobody checks vouch for nothing"
            )
        return self


class Retention(_Section):
    keep_verified: Annotated[int, Field(ge=2)] = Field(
        default=3,
        description="verified checkpoints kept; at least 2, because the newest may be the one "
        "a resumed run is reading while the next is being verified",
    )


class ObjectLock(_Section):
    """S3 Object Lock on a committed archive copy: no one (COMPLIANCE), or no one without the
    bypass permission (GOVERNANCE), may delete or overwrite its objects for ``days`` after the
    commit; archive retention waits for that date."""

    mode: Literal["GOVERNANCE", "COMPLIANCE"]
    days: Annotated[int, Field(ge=1)]


class Archive(_Section):
    """The independent archive: an S3-compatible bucket, or a local directory (same code path)."""

    url: str = Field(description="s3://bucket/prefix, or a directory path")
    endpoint_url: str | None = Field(
        default=None, description="S3-compatible endpoint (MinIO, Ceph RGW); None: AWS"
    )
    region: str | None = None
    aws_profile: str | None = Field(
        default=None,
        description="credentials profile; else the standard AWS chain (env, files, instance role)",
    )
    period_hours: Positive = Field(default=24, description="a new archive copy at most this often")
    keep: Annotated[int, Field(ge=2)] = Field(default=14, description="committed archive copies kept")
    max_concurrency: Annotated[int, Field(ge=1)] = 8
    multipart_chunk_mb: Annotated[int, Field(ge=5)] = 64
    connect_timeout_seconds: Positive = 5
    read_timeout_seconds: Positive = 60
    max_attempts: Annotated[int, Field(ge=1, le=10)] = 3
    readback_fraction: Annotated[float, Field(ge=0, le=1)] = Field(
        default=1 / 7,
        description="S3: the share of copies also read back in full (a rotating choice by the count "
        "of copies so far; the others are checked by the store's CRC64NVME); a local directory "
        "is always read back",
    )
    keep_days: Positive | None = Field(
        default=None,
        description="also keep every copy committed within this many days (a copy goes only when "
        "both keep and keep_days let it)",
    )
    sse: Literal["none", "AES256", "aws:kms"] = Field(
        default="none",
        description="server-side encryption asked for on upload; none: the store's default "
        "(S3: SSE-S3), recorded as the store reports it",
    )
    kms_key_id: str | None = Field(default=None, description="sse aws:kms: the key (id, ARN or alias)")
    bucket_key: bool = Field(default=True, description="sse aws:kms: S3 Bucket Keys (fewer KMS calls)")
    object_lock: ObjectLock | None = Field(
        default=None,
        description="Object Lock on committed copies (the bucket must have Object Lock enabled)",
    )

    @field_validator("url")
    @classmethod
    def _directory_in_profile_folder(cls, url: str, info: ValidationInfo) -> str:
        return url if "://" in url else str(_in_profile_folder(Path(url), info))

    @property
    def is_s3(self) -> bool:
        return self.url.startswith("s3://")

    @property
    def directory(self) -> Path | None:
        """The local directory the archive is; None for a URL (s3://)."""
        return None if "://" in self.url else Path(self.url)

    @model_validator(mode="after")
    def _protection_needs_s3(self):
        if not self.is_s3 and (self.sse != "none" or self.object_lock is not None):
            raise ValueError("sse and object_lock need an s3:// archive")
        if self.kms_key_id is not None and self.sse != "aws:kms":
            raise ValueError("kms_key_id needs sse: aws:kms")
        return self


class Budget(_Section):
    shared: Positive = 600
    archive: Positive = 3600


class SlurmDrill(_Section):
    """The production drill: an allocation that loads the checkpoint with one loader per task."""

    partition: str | None = None
    nodes: Annotated[int, Field(ge=1)]
    ntasks_per_node: Annotated[int, Field(ge=1)] = Field(
        default=8, description="loader processes per node (one per GPU)"
    )
    gpus_per_node: Annotated[int, Field(ge=0)] = Field(
        default=8, description="0: request no GPUs (a CPU partition)"
    )
    time_limit: str = "01:00:00"
    account: str | None = None
    exclusive: bool = True
    python: str | None = Field(
        default=None,
        description="the interpreter with ckptops installed on the nodes; default: the one running the drill",
    )
    prelude: str = Field(default="", description="shell lines run before srun (module load, a venv)")
    srun_args: list[str] = Field(
        default_factory=list, description="more srun options (a container image, ...)"
    )
    master_port: Annotated[int, Field(ge=1024, le=65535)] = 29500


class DrillLayout(_Section):
    """The drill allocation's layout; the load reshards onto it through dist_checkpointing."""

    tensor_parallel: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="default: the checkpoint's"
    )
    pipeline_parallel: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="default: the checkpoint's"
    )
    data_parallel: Annotated[int, Field(ge=1)] = Field(
        default=1, description="local launcher; on Slurm the allocation's tasks decide it"
    )


class Continuation(_Section):
    """The continuation drill: train from the restored copy and compare with the original run."""

    steps: Annotated[int, Field(ge=0)] = Field(
        default=0, description="iterations to train after the restored checkpoint; 0: no continuation"
    )
    script: ProfilePath | None = Field(
        default=None,
        description="the job's batch script, run with CKPT_LOAD, CKPT_STEP, CKPT_EXIT_INTERVAL and "
        "CKPT_LOG in its environment (and --ckpt-step N); default: recovery.script",
    )
    reference: ProfilePath | None = Field(
        default=None, description="the original run's log or step records; default: recovery.step_records"
    )
    tolerance: Literal["exact", "fp32", "bf16"] = Field(
        default="exact",
        description="loss and grad norm: exact (a deterministic job), fp32 1e-6, bf16 1e-6 at the "
        "first iteration and 5e-3 after it (relative)",
    )
    timeout_seconds: Positive = 1800


class Drill(_Section):
    scratch_dir: ProfilePath
    budget_seconds: Budget = Budget()
    tensor_sample: Annotated[int, Field(ge=1)] = Field(
        default=8, description="tensors each rank compares with the stored bytes"
    )
    launcher: Literal["local", "slurm"] = "local"
    slurm: SlurmDrill | None = None
    layout: DrillLayout = DrillLayout()
    model_provider: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="package.module:function building the job's model when it is not a Megatron-Core GPT; "
        "called "
        "as Megatron-LM's gpt_builder: (args, pre_process=..., post_process=...)",
    )
    load_timeout_seconds: Positive = 1800
    estimate_for_bytes: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="predict the restore window for a checkpoint of this size (e.g. 7 TB)"
    )
    continuation: Continuation = Continuation()


class SshAccess(_Section):
    user: str = "root"
    port: Annotated[int, Field(ge=1, le=65535)] = 22
    known_hosts: ProfilePath = Field(
        description="host keys are checked against this file; unknown or changed keys are refused"
    )
    key_file: ProfilePath | None = None
    config_file: ProfilePath | None = Field(
        default=None,
        description="an OpenSSH client config (Host, HostName, Port, User, IdentityFile) that maps "
        "node names to addresses, as ~/.ssh/config does",
    )
    secret_block: str | None = Field(
        default=None, description="a Prefect Secret block holding the private key"
    )
    use_agent: bool = True
    connect_timeout_seconds: Positive = 10


class Nccl(_Section):
    enabled: bool = True
    command: list[str] = ["all_reduce_perf", "-b", "1G", "-e", "8G", "-f", "2", "-g", "8"]
    pass_gbps: Positive = 431  # one node, 8 x H200: a starting gate; replace with the fleet's median
    warn_gbps: Positive = 410
    timeout_seconds: Positive = 900


class Pairs(_Section):
    """Two-node runs against a known-good node, to tell a bad node from a bad fabric."""

    enabled: bool = False
    known_good: str | None = None
    command: list[str] = [
        "mpirun",
        "-np",
        "16",
        "-H",
        "{a}:8,{b}:8",
        "-x",
        "NCCL_ALGO=Ring",
        "all_reduce_perf",
        "-b",
        "1G",
        "-e",
        "8G",
        "-f",
        "2",
        "-g",
        "1",
    ]
    pass_gbps: Positive = 360  # several nodes, 8 x 400G InfiniBand, Ring
    warn_gbps: Positive = 330
    timeout_seconds: Positive = 1200


class Drain(_Section):
    enabled: bool = Field(default=False, description="drain FAIL nodes in Slurm; off: only a drain plan")
    max_per_run: Annotated[int, Field(ge=0)] = 2
    max_per_hour: Annotated[int, Field(ge=0)] = 4
    page_when_same_check_fails: Annotated[int, Field(ge=2)] = Field(
        default=3, description="this many nodes failing one check at once: drain nothing, call a human"
    )


class SuspectRule(_Section):
    """A node named as suspect in ``repeat`` incidents within ``window_days`` (since it last passed
    the spare admission set) is drained and replaced even when its own checks pass."""

    repeat: Annotated[int, Field(ge=1)] = 2
    window_days: Positive = 14


class BurnIn(_Section):
    """Return to service (tasks/health/burn_in.py): what a node ckptops drained must pass."""

    level: Literal[3, 4] = Field(default=3, description="DCGM diag level of a burn-in")
    repeat_level: Literal[3, 4] = Field(
        default=4, description="the level for a repeat suspect (suspect.repeat within suspect.window_days)"
    )
    repeat_hours: Annotated[float, Field(ge=0)] = Field(
        default=24,
        description="a repeat suspect returns only after burn-ins passing without a failure for this long",
    )
    hold_after: Annotated[int, Field(ge=2)] = Field(
        default=3, description="this many suspicions within hold_window_days: held for a person"
    )
    hold_window_days: Positive = 30
    min_ready_spares: Annotated[int, Field(ge=0)] = Field(
        default=0,
        description="fewer spares ready than this (drained spares and spares in use not counted): the "
        "fleet report and a recovery's nodes phase say so, with notify.block a notification",
    )


class GpuProcesses(_Section):
    """The gpu-processes check: compute processes on a node's GPUs that no running Slurm job owns."""

    listpids_node_name: bool = Field(
        default=False,
        description="name the node to `scontrol listpids` (hosts running several slurmd, `slurmd -N`)",
    )


class Conformance(_Section):
    """The conformance check (tasks/health/checks/conformance.py): each node's versions, GPU
    clocks and power limit, NIC firmware and link rate against pins and the fleet's majority."""

    pins: dict[Fact, str | float] = Field(
        default_factory=dict,
        description="the value a fact must have (numbers compare as numbers, anything else exactly); "
        "a pinned fact that cannot be read fails the check as a tool error",
    )
    majority: bool = Field(
        default=True,
        description="compare each node with the strict majority of the nodes checked with it (a spare: "
        "of the fleet's recorded facts)",
    )
    max_age_days: Positive = Field(
        default=7,
        description="recorded facts older than this are not compared (after a fleet-wide upgrade, "
        "the nodes not checked since would outvote the upgraded ones)",
    )
    spares: Literal["refuse", "warn"] = Field(
        default="refuse",
        description="a spare that differs: not admitted, or admitted with a WARN",
    )
    nccl_command: list[str] = Field(
        default_factory=list,
        description="run on the node in the job's environment, printing the NCCL version (e.g. a python "
        "printing torch.cuda.nccl.version()); empty: NCCL's version is not read",
    )

    @model_validator(mode="after")
    def _nccl_readable(self):
        if "nccl" in self.pins and not self.nccl_command:
            raise ValueError("pins.nccl needs nccl_command (how to read the NCCL version on a node)")
        return self


class Health(_Section):
    nodes: list[str] = Field(default_factory=list)
    slurm_partition: str | None = None
    slurm_nodelist: str | None = None
    spares: list[str] = Field(default_factory=list)
    transport: Literal["ssh", "local"] = "ssh"
    ssh: SshAccess | None = None
    gpus_per_node: Annotated[int, Field(ge=1)] = 8
    level: Literal[1, 2, 3, 4] = 1
    concurrency: Annotated[int, Field(ge=1)] = 32
    command_timeout_seconds: Positive = 60
    diag_timeout_seconds: dict[int, Positive] = Field(
        default_factory=lambda: {1: 300, 2: 900, 3: 7200, 4: 14400}
    )
    node_timeout_seconds: Positive = 10800
    # conformance is not run unless listed: a fleet mid-upgrade would otherwise fail its minority.
    checks: list[NodeCheck] = Field(
        default_factory=lambda: [c for c in get_args(NodeCheck) if c != CheckName.CONFORMANCE]
    )
    critical_xids: list[int] = Field(
        default_factory=lambda: sorted(CRITICAL_XIDS),
        description="XIDs that fail a node (tasks/health/xids.py)",
    )
    nccl: Nccl = Nccl()
    pairs: Pairs = Pairs()
    drain: Drain = Drain()
    suspect: SuspectRule = SuspectRule()
    burn_in: BurnIn = BurnIn()
    gpu_processes: GpuProcesses = GpuProcesses()
    conformance: Conformance = Conformance()
    nvrx_segment_dir: ProfilePath | None = Field(
        default=None,
        description="NVRx's --ft-segment-health-check-dir: a segment file for each running job on a "
        "node judged unhealthy, removed when the node passes again",
    )
    nvrx_exclusion_dir: ProfilePath | None = Field(
        default=None,
        description="NVRx's --ft-scheduler-exclusion-dir: scheduler_exclusion.<job_id>.jsonl for each job "
        "running on an excluded node, rewritten on every sweep and burn-in (NVRx ignores one 30 min old)",
    )
    raw_dir: ProfilePath

    @model_validator(mode="after")
    def _consistent(self):
        if self.transport == "ssh" and self.ssh is None:
            raise ValueError("transport ssh needs an ssh section (known_hosts at least)")
        if not (self.nodes or self.slurm_partition or self.slurm_nodelist):
            raise ValueError("name the nodes: nodes, slurm_partition or slurm_nodelist")
        if self.pairs.enabled and not self.pairs.known_good:
            raise ValueError("pairs.enabled needs pairs.known_good")
        return self


class Resume(_Section):
    """Post-resume validation: windows and tolerances."""

    warmup_steps: Annotated[int, Field(ge=0)] = Field(
        default=10, description="steps skipped after a (re)start before timing"
    )
    window_steps: Annotated[int, Field(ge=1)] = Field(
        default=100, description="pre-failure steady-state steps in the baseline"
    )
    min_steps: Annotated[int, Field(ge=1)] = Field(
        default=10, description="steady-state steps needed after resume"
    )
    loss_rel_tolerance: Annotated[float, Field(ge=0)] = Field(
        default=1e-3, description="0: bit-exact recomputed loss"
    )
    first_rel_tolerance: Annotated[float, Field(ge=0)] | None = Field(
        default=None,
        description="the first iteration after the checkpoint's, where it is tighter (nothing has "
        "drifted yet); default: loss_rel_tolerance",
    )
    memory_band: Annotated[float, Field(gt=0)] = 0.05
    throughput_drop: Annotated[float, Field(gt=0, lt=1)] = 0.05
    pointer_window_seconds: Annotated[float, Field(ge=0)] = Field(
        default=1800,
        description="a resume may start from any checkpoint promoted this long before its first step "
        "(the load, and the clocks of two hosts)",
    )


class Recovery(_Section):
    """The recovery run: how the job is relaunched after a failure, and when a human decides."""

    launcher: Literal["slurm", "local"] = "slurm"
    script: ProfilePath = Field(
        description="the job's own batch script: sbatch'ed on Slurm, run with bash locally; it must "
        "pass --exit-on-missing-checkpoint to Megatron and no --non-persistent-ckpt-type"
    )
    pass_step: list[Literal["env", "arg"]] = Field(
        default=["env", "arg"],
        min_length=1,
        description="how the chosen iteration reaches the job: CKPT_STEP in the environment, "
        "--ckpt-step N after the script",
    )
    job_name: str | None = Field(
        default=None, description="Slurm job name for --dependency=singleton (default: job.name)"
    )
    nodes: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="nodes the job runs on (default: what the failed job had)"
    )
    gpus: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="GPUs the job holds, for lost GPU-hours (default: the layout's world size)"
    )
    step_records: ProfilePath | None = Field(
        default=None, description="the job's step records (or its Megatron log): progress and validation"
    )
    log_dir: ProfilePath | None = Field(
        default=None, description="where relaunched jobs write their output (default: <save_dir>/../logs)"
    )
    flight_recorder_dir: ProfilePath | None = Field(
        default=None,
        description="where the job's ranks dump PyTorch's Flight Recorder (the folder of its "
        "TORCH_FR_DUMP_TEMP_FILE prefix): read for a hang, to name the ranks that never entered the "
        "collective the others wait in",
    )
    skip_bad_data: Literal["ask", "auto", "never"] = Field(
        default="ask",
        description="a data failure (Megatron's rerun state machine reproduced a rejected result on "
        "another GPU): relaunch past that iteration with --iterations-to-skip when a person approves "
        "(ask), without asking (auto), or not at all (never: the recovery stops for a person)",
    )
    max_per_hour: Annotated[int, Field(ge=1)] = 3
    fallback_within_iterations: Annotated[int, Field(ge=1)] = Field(
        default=50,
        description="a numerical failure (NaN, Inf, a loss spike) this soon after the checkpoint the "
        "last relaunch loaded: that checkpoint is suspect, the next recovery falls back to the "
        "verified one before it (pinned); a second time, the stop rules stop",
    )
    auto_approve: list[FailureClass] = Field(
        default_factory=list, description="classes relaunched without asking, while budget is left"
    )
    approval_timeout_seconds: Positive = 1800
    progress_steps: Annotated[int, Field(ge=1)] = 5
    progress_timeout_seconds: Positive = 1800
    on_rejected: Literal["stop", "warn"] = Field(
        default="stop", description="a rejected resume: stop the job (scancel) and page, or only warn"
    )
    reverify: Literal["full", "manifest"] = Field(
        default="full",
        description="the chosen checkpoint is verified again before the relaunch: every byte with "
        "the profile's engine (full), or its files' sizes and times against the manifest; never off",
    )
    lock_timeout_seconds: Annotated[float, Field(ge=0)] = Field(
        default=7200,
        description="how long a recovery of another failure waits for the one in progress "
        "(one recovery per job at a time)",
    )
    job_python: list[str] | None = Field(
        default=None,
        min_length=1,
        description="the command that starts the job's Python (its venv's python, or srun into its "
        "container): before a relaunch ckptops runs it with -c to read megatron-core, torch, CUDA and "
        "NCCL versions (bounded by 120 s) and warns where they differ from the checkpoint's writer",
    )


class Notify(_Section):
    """Who hears about what needs a person: stop-and-page, a failed drill, a rejected resume, a
    recovery that stops or waits for approval."""

    block: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9-]+/[A-Za-z0-9_.-]+$",
        description="a Prefect notification block, TYPE-SLUG/NAME (e.g. slack-webhook/oncall)",
    )


class Prefect(_Section):
    api_url: str = "http://127.0.0.1:4200/api"
    home: ProfilePath | None = None
    submission_timeout_seconds: Annotated[float, Field(ge=10)] = Field(
        default=600,
        description="a run pending this long without starting is crashed by the watchdog automation "
        "(its worker died while submitting it), which gives its concurrency slot back",
    )
    silent_run_seconds: Annotated[float, Field(ge=35)] = Field(
        default=90,
        description="a running run without a heartbeat this long (runs beat every 30 s) is crashed by "
        "the watchdog automation (its process died), which gives its concurrency slot back",
    )


class LocalJob(_Section):
    """How the demo runs the local training job (embedded default only)."""

    nproc: Annotated[int, Field(ge=1)] = 2
    train_iters: Annotated[int, Field(ge=1)] = 12
    save_interval: Annotated[int, Field(ge=1)] = 4
    timeout_seconds: Positive = 600


# The folders a drill's scratch may not lie inside: what a resume reads and what it is copied from.
_HOLD_NO_SCRATCH = ("job.save_dir", "archive.url")


class Profile(_Section):
    job: Job
    verify: Verify = Verify()
    retention: Retention = Retention()
    prefect: Prefect = Prefect()
    archive: Archive | None = None
    drill: Drill | None = None
    health: Health | None = None
    resume: Resume = Resume()
    local_job: LocalJob | None = None
    recovery: Recovery | None = None
    notify: Notify | None = None
    sign: Sign | None = None
    source: Path | None = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _signing_needs_a_cryptographic_digest(self):
        signs = self.sign and (self.sign.key_file or self.sign.key_secret)
        if signs and PROFILE_NAMES[self.verify.digest] not in CRYPTOGRAPHIC:
            raise ValueError(
                "sign: a signature vouches only for cryptographic digests: "
                "set verify.digest to blake3 or sha256"
            )
        return self

    @model_validator(mode="after")
    def _slurm_drill_has_settings(self):
        if self.drill and self.drill.launcher == "slurm" and self.drill.slurm is None:
            raise ValueError("drill.launcher is slurm but drill.slurm is missing")
        return self

    @model_validator(mode="after")
    def _scratch_of_its_own(self):
        """Drills remove only what they made in their scratch dir, but a scratch dir that is or
        holds any other path the profile names, or lies inside the job's save directory or a
        local archive, mixes what ckptops makes and deletes with what it must never touch:
        refused. (Inside another of the profile's folders, a scratch dir of its own is fine: a
        shared scratch file system holding both.)"""
        if self.drill is None:
            return self
        scratch = self.drill.scratch_dir.resolve()
        for key, value in self._paths():
            there = value.resolve()
            if key == "drill.scratch_dir":
                continue
            if there == scratch:
                relation = "is"
            elif scratch in there.parents:
                relation = "contains"
            elif there in scratch.parents and key in _HOLD_NO_SCRATCH:
                relation = "lies inside"
            else:
                continue
            raise ValueError(
                f"drill.scratch_dir {self.drill.scratch_dir} {relation} {key} {value}: "
                "a drill's scratch must be a folder of its own"
            )
        return self

    def _paths(self) -> Iterator[tuple[str, Path]]:
        """Every path the profile names, with its key: its path fields' values and a local archive."""
        yield from _paths_in(self, ())
        if self.archive is not None and self.archive.directory is not None:
            yield "archive.url", self.archive.directory

    @model_validator(mode="after")
    def _local_job_matches_layout(self):
        if self.local_job and self.local_job.nproc != self.job.layout.world_size:
            raise ValueError(
                f"local_job.nproc ({self.local_job.nproc}) must equal the layout's world size "
                f"({self.job.layout.world_size})"
            )
        return self


def _paths_in(value, keys: tuple[str, ...]) -> Iterator[tuple[str, Path]]:
    """The paths in ``value`` (a section, a list, a mapping or a path), each with its key."""
    if isinstance(value, Path):
        yield ".".join(keys), value
    elif isinstance(value, BaseModel):
        for name, info in type(value).model_fields.items():
            if not info.exclude:
                yield from _paths_in(getattr(value, name), (*keys, name))
    elif isinstance(value, list):
        for index, one in enumerate(value):
            yield from _paths_in(one, (*keys, str(index)))
    elif isinstance(value, dict):
        for key, one in value.items():
            yield from _paths_in(one, (*keys, str(key)))


def _one_line(error: ValidationError, path: Path) -> str:
    """Every problem of the profile, each naming its key, in one line."""
    said = [f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}" for e in error.errors()]
    return f"{path}: " + "; ".join(said)


def profile_path(name_or_path: str | Path | None) -> Path:
    """A profile name (``local``) looks in the site's directory ``$CKPTOPS_PROFILES`` first (a
    deployment's ``profile: gpt-500b`` then means that site's file, e.g. in /etc/ckptops/profiles),
    then in the shipped ``profiles/``; anything with a suffix or a slash is a path."""
    value = str(name_or_path or DEFAULT_PROFILE)
    if value.endswith((".yaml", ".yml")) or "/" in value:
        return Path(value)
    site = os.environ.get(PROFILES_ENV)
    if site and (Path(site) / f"{value}.yaml").is_file():
        return Path(site) / f"{value}.yaml"
    return PROFILES_DIR / f"{value}.yaml"


def _where_named(name_or_path) -> str:
    """For a bare name not found: where names are looked up, and a file of that name here."""
    value = str(name_or_path or DEFAULT_PROFILE)
    if value.endswith((".yaml", ".yml")) or "/" in value:
        return ""
    here = Path(f"{value}.yaml")
    site = os.environ.get(PROFILES_ENV)
    where = f"${PROFILES_ENV}" + (f" ({site})" if site else ", unset,")
    return (
        f" (a name is looked up in {where} and in {PROFILES_DIR}"
        + (f"; for the file in this directory give -p ./{here}" if here.is_file() else "; give a path")
        + ")"
    )


def load_profile(name_or_path: str | Path | None = None) -> Profile:
    """The profile a name or path gives (``profile_path``), read as every file ckptops did not
    write is read (``tasks.storage.bounded``: a regular file, at most ``MAX_PROFILE_BYTES``, nested
    at most ``MAX_DEPTH`` deep) and validated; each problem is one ``UsageError`` line naming the
    file and the key (``Unreadable`` where the system kept it from being read)."""
    path = profile_path(name_or_path)
    data = _profile_bytes(path, name_or_path)
    try:
        loaded = load_yaml(data, path, "profile")
    except Malformed as e:
        raise UsageError(str(e)) from None
    if not isinstance(loaded, dict):
        raise UsageError(f"{path}: a profile must be a mapping with a 'job' section")
    _refuse_repeated_keys(_composed(data), path)
    try:
        profile = Profile.model_validate(loaded, context={"base": path.resolve().parent})
    except ValidationError as e:
        raise UsageError(_one_line(e, path)) from None
    return profile.model_copy(update={"source": path.resolve()})


def _profile_bytes(path: Path, name_or_path) -> bytes:
    """The profile file's bytes: a FIFO, a device or a directory refused in one line naming it
    (a FIFO would block the reader for ever), a file past ``MAX_PROFILE_BYTES`` too."""
    if not path.exists():
        raise UsageError(f"{path}: profile not found{_where_named(name_or_path)}")
    try:
        return read_bounded(path, MAX_PROFILE_BYTES, "the profile")
    except Malformed as e:
        raise UsageError(str(e)) from None
    except UsageError as e:
        raise UsageError(f"{path}: cannot read the profile ({str(e).removeprefix(f'{path}: ')})") from None


def _text(data: bytes) -> str:
    """The profile's text, decoded as YAML's reader decodes it (UTF-16 after its byte order mark,
    else UTF-8); only called on bytes that loaded."""
    utf16 = data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))
    return data.decode("utf-16" if utf16 else "utf-8")


def _composed(data: bytes) -> yaml.Node | None:
    """The profile's YAML node tree, each node with where it stands in the text (``_text``)."""
    return yaml.compose(_text(data), Loader=yaml.SafeLoader)


def _nodes(root: yaml.Node | None) -> Iterator[yaml.Node]:
    """Each node of the tree once (an alias shares its node: walked once), without recursion."""
    pending, seen = [root], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if isinstance(node, yaml.MappingNode):
            pending.extend(n for pair in node.value for n in pair)
        elif isinstance(node, yaml.SequenceNode):
            pending.extend(node.value)


def _refuse_repeated_keys(root: yaml.Node | None, path: Path) -> None:
    """A key given twice in one mapping is refused: YAML's loader keeps the last without a word,
    so a line added after a key (a job name holding a line break, a pasted block) would quietly
    move the job to another save directory."""
    for node in _nodes(root):
        if not isinstance(node, yaml.MappingNode):
            continue
        first: dict[str, int] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode):
                continue
            line = key.start_mark.line + 1
            if key.value in first:
                raise UsageError(
                    f"{path}: line {line}: {key.value} is given twice in one mapping (first at line "
                    f"{first[key.value]}); YAML would keep the last: give it once"
                )
            first[key.value] = line


_LINE_BREAK = re.compile("[\r\n\x85\u2028\u2029]")


def unquoted_values_cut_short(profile: Profile) -> list[str]:
    """The paths and the job name whose line in the profile file says more than YAML reads: an
    unquoted value followed on its line by `` #...`` (a save directory ``job #1`` read as ``job``),
    or folded from several lines. What a profile names is what ckptops acts on, as root in
    retention and recovery; a file only holds what was loaded, so the check is made against the
    file's own text: a plain (unquoted) scalar ends where YAML ends it, and whatever follows it on
    its line, or the lines it was folded from, is what a reader may have taken for part of it.
    ``ckptops profile init`` quotes every value, so its profiles never show here. One line per
    value, naming its key, what YAML reads and what follows it."""
    if profile.source is None:
        return []
    data = _profile_bytes(profile.source, profile.source)
    text, root = _text(data), _composed(data)
    found = []
    for key in ["job.name", *(key for key, _ in profile._paths())]:
        node = _value_node(root, key.split("."))
        if not isinstance(node, yaml.ScalarNode) or node.style is not None:
            continue
        start, end = node.start_mark, node.end_mark
        if start.line != end.line:
            found.append(
                f"{key}: reads {node.value!r}, folded from lines {start.line + 1}-{end.line + 1}: "
                "quote it, on one line"
            )
            continue
        stop = _LINE_BREAK.search(text, end.index)
        rest = text[end.index : stop.start() if stop else len(text)]
        if rest.lstrip().startswith("#"):
            found.append(
                f"{key}: reads {node.value!r} but line {end.line + 1} goes on {rest.strip()!r}, a comment "
                "to YAML: quote the value if that is part of it, or put the comment on a line of its own"
            )
    return found


def _value_node(root: yaml.Node | None, keys: list[str]) -> yaml.Node | None:
    """The node at ``keys`` (mapping keys, and list positions as digits) in the tree; None when
    the file does not give it (a default)."""
    node = root
    for key in keys:
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)
        elif isinstance(node, yaml.SequenceNode) and key.isdigit() and int(key) < len(node.value):
            node = node.value[int(key)]
        else:
            return None
    return node
