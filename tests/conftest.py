"""Shared fixtures: real checkpoints from the local training job, and a real Prefect server.

Each distinct run of the training job is trained once per test run (``trained_once``, keyed by
its arguments), shared by every xdist worker; each test that breaks or promotes something works
on its own copy.
"""

import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from infra.local_job.launch import PRETRAIN, run_local_job
from tasks.checkpoint.state import VerifyOptions
from tests.helpers import warm
from tests.helpers.receiver import Receiver

ROOT = Path(__file__).resolve().parent.parent
# A Prefect call that finds no server (a thread without the run's context, a test without the
# prefect_api fixture) fails instead of starting a temporary server of its own.
os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = "false"
ITERATIONS = [4, 8, 12, 16, 20, 24]


# A test that uses one of these (directly or through another fixture) trains, starts a server or
# needs a cluster: it is marked slow, and make test-quick leaves it out.
HEAVY_FIXTURES = frozenset(
    {"trained", "medium_trained", "variety", "prefect_api", "cluster", "slurm_conf", "postgres"}
    | {"s3_endpoint", "failed", "ecc_run", "nan_run", "per_iteration_run", "saving"}
    | {"corrupted", "corrupted_distopt", "corrupted_fully_reshardable", "fp16_skipping", "on_indexed_data"}
    | {"on_blended_data", "nan_data"}
)
# Modules whose tests train or start servers themselves (each fault's job, each resumed run, the
# packaging install, the demo, PostgreSQL).
HEAVY_MODULES = frozenset(
    {
        "test_faults",
        "test_resume",
        "test_packaging",
        "test_demo",
        "test_production",
        "test_warm",
        "test_flight_recorder",
    }
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    first = {}
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if HEAVY_FIXTURES & set(item.fixturenames) or module in HEAVY_MODULES:
            item.add_marker(pytest.mark.slow)
        group = xdist_group(item, module)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
        first[item.nodeid] = next((i for i, name in enumerate(FIRST) if name in (group, module)), len(FIRST))
    # The longest work first: a group runs on one worker start to end, and a long test or group
    # handed out last leaves the other worker idle while it finishes (a minute, measured). The
    # rest keeps its order.
    items.sort(key=lambda item: first[item.nodeid])


# The groups and modules whose tests take longest, longest first: the Slurm cluster's tests, make
# demo's story, the recoveries, the resumes, PostgreSQL, the dead worker, the faults' timeouts.
FIRST = (
    "slurm",
    "test_demo",
    "test_recovery_safety",
    "test_resume",
    "test_production",
    "test_watchdog",
    "test_faults",
    "test_promote",
    "test_continuation",
)


def xdist_group(item, module: str) -> str | None:
    """Which tests must share one xdist worker (``--dist loadgroup``): every test on the local
    Slurm cluster (they drain and restart its three nodes), and the tests of a module that share a
    module-scoped fixture (a server on fixed addresses, a failed job the whole module reads);
    every other test goes wherever a worker is free."""
    if "slurm_conf" in item.fixturenames:
        return "slurm"
    fixtures = item._fixtureinfo.name2fixturedefs.values()
    if any(definition.scope == "module" for definitions in fixtures for definition in definitions):
        return module
    return None


def pytest_collection_finish(session) -> None:
    """On an xdist worker with --dist loadgroup, the groups must have reached xdist's scheduler
    (as a suffix of each node id): a pytest that drops them would spread a group's tests over
    the workers, silently, and with them the cluster and the module fixtures they share. The
    worker stops, and leaves the reason where the controller's summary prints it."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        reason = (
            f"{lost[0]}: its xdist_group did not reach xdist's scheduler (pytest-dev/pytest-xdist#1386); "
            "install the pytest that pyproject.toml allows"
        )
        (session.config._tmp_path_factory.getbasetemp().parent / "xdist-groups-lost").write_text(reason)
        raise pytest.UsageError(reason)


def pytest_unconfigure(config) -> None:
    """The controller says why a worker stopped for lost groups (its own report does not)."""
    if hasattr(config, "workerinput") or config.getoption("dist", "no") != "loadgroup":
        return
    lost = config._tmp_path_factory.getbasetemp() / "xdist-groups-lost"
    if lost.exists():
        print(f"\nERROR: {lost.read_text()}", file=sys.stderr)


def pytest_configure(config) -> None:
    """Unless only the quick tests run, Megatron's processes start warm (tests/helpers/warm):
    forked from servers that imported torch and megatron once, started here for the whole run
    (xdist's workers inherit them)."""
    quick = config.getoption("markexpr") == "not slow"
    if quick or os.environ.get("CKPTOPS_WARM", "1") == "0" or "CKPTOPS_WARM_DIR" in os.environ:
        return
    folder = Path(tempfile.mkdtemp(prefix="ckptops-warm-"))
    servers = warm.start_servers(folder)

    def stop() -> None:
        warm.stop_servers(servers)
        shutil.rmtree(folder, ignore_errors=True)

    config.add_cleanup(stop)


def once(tmp_path_factory, key: str, build, wait: bool = True) -> Path | None:
    """A folder that ``build(folder)`` fills once for the whole test run: the first xdist worker
    (or the only process) to ask builds it, under a lock the others wait on; they all get it
    built. A build that raised is tried again by the next to ask. With ``wait=False``, None
    while another process is building it."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built-once"
    # A development accelerator: CKPTOPS_BUILT_ONCE names a folder kept across runs (and shared
    # by runs side by side), so a targeted test does not train its fixtures again. CI leaves it unset.
    shared = Path(os.environ.get("CKPTOPS_BUILT_ONCE", shared))
    shared.mkdir(parents=True, exist_ok=True)
    folder = shared / key
    with open(shared / f"{key}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return None
        if not (shared / f"{key}.built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (shared / f"{key}.built").touch()
    return folder


def all_once(tmp_path_factory, builds: dict[str, object]) -> dict[str, Path]:
    """``once`` for many keys, shared out: a worker builds the keys no other worker is building
    and only then waits for the others', so workers that ask together build side by side."""
    done = {key: once(tmp_path_factory, key, build, wait=False) for key, build in builds.items()}
    return {key: folder or once(tmp_path_factory, key, builds[key]) for key, folder in done.items()}


def trained_once(tmp_path_factory, *, timeout_seconds: float = 600, **job) -> Path:
    """The save directory of one run of the local job with these arguments (``run_local_job``'s),
    trained once per test run whichever tests ask for it: copy it, never change it."""
    key = hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode()).hexdigest()[:16]
    folder = once(
        tmp_path_factory,
        f"job-{key}",
        lambda root: run_local_job(root / "checkpoints", timeout_seconds=timeout_seconds, **job),
    )
    return folder / "checkpoints"


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """A save directory with six real torch_dist checkpoints (iterations 4..24, with Megatron's
    integrity.json), written by the local tiny Megatron-Core job on two CPU ranks."""
    return trained_once(tmp_path_factory, train_iters=24, save_interval=4, extra=["--verify-integrity"])


# The saves of one run, each with one wrong state Megatron-LM wrote with valid CRCs (the fault
# acts on what that save writes: the run itself goes on healthy), and healthy saves around them.
# 16's changed scheduler is valid by every check of its files: only a continuation catches it.
CORRUPTED = {
    4: "stale",
    6: "nan-weight",
    8: "inf-exp-avg",
    10: "negative-exp-avg-sq",
    12: "step-ahead",
    14: "drop-tensor",
    16: "lr-schedule",
    18: "spike",
}
CORRUPTED_DISTOPT = {4: "step-ahead", 6: "nan-weight", 8: "negative-exp-avg-sq"}


def _train_corrupted(tmp_path_factory, faults: dict[int, str], extra: list[str]) -> Path:
    switches = [a for iteration, kind in faults.items() for a in ("--corrupt-save", f"{iteration}:{kind}")]
    return trained_once(
        tmp_path_factory, train_iters=max(faults) + 2, save_interval=2, extra=[*switches, *extra]
    )


@pytest.fixture(scope="session")
def corrupted(tmp_path_factory) -> Path:
    """Saves 2..20 of the default job (plain Adam, fp32), the faults of CORRUPTED in theirs."""
    return _train_corrupted(tmp_path_factory, CORRUPTED, [])


@pytest.fixture(scope="session")
def corrupted_distopt(tmp_path_factory) -> Path:
    """Saves 2..10 of a bf16 job with the distributed optimizer (dp_reshardable buckets: fp32
    main params and moments, with intra-param padding), the faults of CORRUPTED_DISTOPT."""
    extra = ["--use-distributed-optimizer", "--bf16"]
    return _train_corrupted(tmp_path_factory, CORRUPTED_DISTOPT, extra)


@pytest.fixture(scope="session")
def corrupted_fully_reshardable(tmp_path_factory) -> Path:
    """Saves 2..6 of a job whose distributed optimizer saves fully reshardable (its param groups,
    steps among them, in the common state), the save of 4 with the step one ahead."""
    extra = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
    return _train_corrupted(tmp_path_factory, {4: "step-ahead"}, extra)


@pytest.fixture(scope="session")
def fp16_skipping(tmp_path_factory) -> Path:
    """Saves 4, 8 and 12 of an fp16 job whose loss scale starts high enough (2^23) that the
    grad scaler skips its first iterations (1-6 on the local job's mock data): no optimizer step
    before the save at 4, then fewer steps than iterations."""
    extra = ["--fp16", "--initial-loss-scale", str(2**23)]
    return trained_once(tmp_path_factory, train_iters=12, save_interval=4, extra=extra)


@pytest.fixture(scope="session")
def on_indexed_data(tmp_path_factory) -> tuple[Path, Path]:
    """Saves 4, 8 and 12 of the job on a real indexed dataset (megatron-core's builder) read by
    GPTDataset, with its index files in a data cache as on a cluster: (save dir, data cache)."""
    from infra.local_job.dataset import build as build_dataset

    data = once(tmp_path_factory, "indexed-data", lambda folder: build_dataset(folder / "tokens"))
    extra = [
        "--data-path",
        str(data / "tokens"),
        "--split",
        "100,0,0",
        "--data-cache-path",
        str(data / "cache"),
    ]
    return trained_once(tmp_path_factory, train_iters=12, save_interval=4, extra=extra), data / "cache"


@pytest.fixture(scope="session")
def on_blended_data(tmp_path_factory) -> tuple[Path, Path]:
    """Saves 4 and 8 of the job on a blend of two real indexed datasets (30% and 70%), read by
    Megatron's BlendedDataset over two GPTDatasets, their indices in a data cache: (save dir, cache)."""
    from infra.local_job.dataset import build as build_dataset

    def both(folder: Path) -> Path:
        build_dataset(folder / "tokens-a", seed=11)
        build_dataset(folder / "tokens-b", seed=12)
        return folder

    data = once(tmp_path_factory, "blended-data", both)
    blend = ["0.3", str(data / "tokens-a"), "0.7", str(data / "tokens-b")]
    extra = ["--data-path", *blend, "--split", "100,0,0", "--data-cache-path", str(data / "cache")]
    return trained_once(tmp_path_factory, train_iters=8, save_interval=4, extra=extra), data / "cache"


@pytest.fixture
def save_dir(trained, tmp_path) -> Path:
    """A private copy of the trained save directory (mtimes kept) to break, verify and promote."""
    return shutil.copytree(trained, tmp_path / "checkpoints")


@pytest.fixture
def options() -> VerifyOptions:
    return VerifyOptions(job="test", megatron_core_version="0.19.2")


def iter_dir(save_dir: Path, iteration: int) -> Path:
    return save_dir / f"iter_{iteration:07d}"


def verify_and_record_here(directory: Path, options: VerifyOptions, **kwargs):
    """Verify a checkpoint and record its manifest, as promotion does: under its job lock."""
    from tasks.checkpoint.lock import job_lock
    from tasks.checkpoint.verify import verify_and_record

    with job_lock(Path(directory).parent, 30) as held:
        return verify_and_record(directory, options, held, **kwargs)


def flip_byte(path: Path, offset: int) -> None:
    """Flip one bit the way bit rot does: the content changes, the file's times do not."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x01]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def exited_process_identity() -> dict:
    """The identity (host, pid, start time) of a process that ran and has exited: what a holder
    killed with SIGKILL leaves in its lease or scratch directory."""
    import json
    import sys

    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from tasks.cluster.process import identity; print(json.dumps(identity()))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    return json.loads(child.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefect_database(tmp_path_factory) -> Path:
    """An empty SQLite database of Prefect's with every migration applied (``prefect server
    database upgrade``), made once per test run: a server started on a copy of it skips the
    migrations, about 12 of the 15 CPU-s a fresh server spends starting. make demo's test starts
    its server on no database, as make demo does on a fresh machine."""
    from tasks.prefect_server import QUIET

    def build(folder: Path) -> None:
        env = {**os.environ, **QUIET, "PREFECT_HOME": str(folder)}
        env.pop("PREFECT_API_URL", None)
        command = [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    return once(tmp_path_factory, "prefect-database", build) / "prefect.db"


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real ``prefect server start`` (SQLite) on a free loopback port, for the whole session."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from tasks.prefect_server import start_server

    home = tmp_path_factory.mktemp("prefect-home")
    shutil.copyfile(prefect_database(tmp_path_factory), home / "prefect.db")
    url = f"http://127.0.0.1:{free_port()}/api"
    process = start_server(url, home, home / "server.log", timeout_seconds=300)
    # Both: the settings context for this thread, the environment for threads and subprocesses.
    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME")}
    os.environ.update(PREFECT_API_URL=url, PREFECT_HOME=str(home))
    try:
        with temporary_settings({PREFECT_API_URL: url, PREFECT_HOME: str(home)}):
            yield url
            # Send what the flows logged and emitted while the server still listens: drained at
            # exit instead, it would go to a server already stopped (or to a temporary one).
            APILogWorker.drain_all(timeout=30, at_exit=False)
            EventsWorker.drain_all(timeout=30, at_exit=False)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except Exception:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible server (moto in server mode) on a loopback port, for the session."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    saved = {
        k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="ckptops-test", AWS_SECRET_ACCESS_KEY="ckptops-test", AWS_DEFAULT_REGION="us-east-1"
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def s3_bucket(endpoint: str, name: str) -> str:
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def write_job_profile(
    tmp_path: Path,
    save_dir: Path,
    archive_url: str | None = None,
    endpoint: str | None = None,
    budget: float = 600,
    keep: int = 3,
    extra_archive: str = "",
    layout: str = "data_parallel: 2",
    drill_extra: str = "",
) -> Path:
    """A profile for a test job: the save directory (saved with ``layout``), an archive, drills in
    tmp_path/scratch."""
    lines = [
        f"job: {{name: test-job, save_dir: '{save_dir}', megatron_core_version: '0.19.2', "
        f"layout: {{{layout}}}}}",
        "verify: {lock_timeout_seconds: 30}",
        f"drill: {{scratch_dir: '{tmp_path / 'scratch'}', "
        f"budget_seconds: {{shared: {budget}, archive: {budget}}}, "
        f"load_timeout_seconds: 600{drill_extra}}}",
    ]
    if archive_url:
        endpoint_line = f", endpoint_url: '{endpoint}'" if endpoint else ""
        lines.append(f"archive: {{url: '{archive_url}', keep: {keep}{endpoint_line}{extra_archive}}}")
    path = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*.yaml')))}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass(frozen=True)
class Variant:
    """A job the local trainer writes, as its users' jobs differ: its switches, the layout it
    saves with (for its profile), and what its drill should report."""

    name: str
    switches: tuple[str, ...]
    layout: str
    nproc: int = 2
    entry: Path = PRETRAIN  # Megatron-LM's loop, or another loop taking the same arguments
    save_interval: int = 4
    train_iters: int = 4  # its newest checkpoint, the one its drill loads


# Six architectures and layouts (the default job is the seventh): what users bring.
VARIANTS = {
    v.name: v
    for v in (
        Variant(
            "tp2-distopt-bf16",
            (
                "--tensor-model-parallel-size",
                "2",
                "--use-distributed-optimizer",
                "--bf16",
                "--verify-integrity",
            ),
            "tensor_parallel: 2",
        ),
        Variant(
            "dp2-other-shape",
            (
                "--num-layers",
                "3",
                "--hidden-size",
                "96",
                "--num-attention-heads",
                "6",
                "--vocab-size",
                "200",
                "--seq-length",
                "48",
                "--use-distributed-optimizer",
                "--drop-saved-arg",
                "num_layers",
            ),
            "data_parallel: 2",
        ),
        Variant(
            "pp2",
            (
                "--pipeline-model-parallel-size",
                "2",
            ),
            "pipeline_parallel: 2",
        ),
        Variant("tp2-bf16", ("--tensor-model-parallel-size", "2", "--bf16"), "tensor_parallel: 2"),
        Variant(
            "llama-like",
            (
                "--swiglu",
                "--position-embedding-type",
                "rope",
                "--normalization",
                "RMSNorm",
                "--group-query-attention",
                "--num-query-groups",
                "2",
                "--untie-embeddings-and-output-weights",
                "--disable-bias-linear",
                "--qk-layernorm",
            ),
            "data_parallel: 2",
        ),
        Variant(
            "no-heads-arg",
            ("--drop-saved-arg", "num_attention_heads", "--drop-saved-arg", "kv_channels"),
            "data_parallel: 2",
        ),
        # Saves written in the background by Megatron-LM's persistent worker, under another LR
        # schedule (warm-up, then WSD with a cosine decay), with the saved event after each.
        Variant(
            "async-wsd",
            (
                "--async-save",
                "--use-persistent-ckpt-worker",
                "--async-strategy",
                "mcore",
                "--lr-warmup-iters",
                "1",
                "--lr-decay-style",
                "WSD",
                "--lr-wsd-decay-style",
                "cosine",
                "--lr-wsd-decay-iters",
                "2",
                "--lr-decay-iters",
                "4",
            ),
            "data_parallel: 2",
            save_interval=2,
        ),
        # A Megatron-Core loop that is not pretrain, with param groups of its own.
        Variant(
            "own-loop-groups",
            ("--own-param-groups",),
            "data_parallel: 2",
            entry=ROOT / "tests" / "helpers" / "core_loop.py",
        ),
        # NeMo's Megatron-Bridge layout, written by Bridge's own save_checkpoint (0.6.2) from the
        # Megatron-Core loop: train_state.pt, run_config.yaml, tokenizer/, energon/ per DP rank;
        # saves at 4 and 8, its log the four iterations after 4 that a continuation replays.
        Variant(
            "bridge",
            (
                "--writer",
                "bridge",
                "--bridge-vocab",
                str(ROOT / "tests" / "data" / "bridge" / "vocab.json"),
                "--bridge-merges",
                str(ROOT / "tests" / "data" / "bridge" / "merges.txt"),
            ),
            "data_parallel: 2",
            entry=ROOT / "tests" / "helpers" / "core_loop.py",
            train_iters=8,
        ),
        # A Megatron-Core loop that configures DDP in code: TP2, the distributed optimizer, bf16
        # with gradients reduced in fp32, in three buckets; its saved args say neither.
        Variant(
            "core-fp32-grads",
            (
                "--tensor-model-parallel-size",
                "2",
                "--use-distributed-optimizer",
                "--bf16",
                "--megatron-core-configs",
                "--ddp-bucket-size",
                "20000",
            ),
            "tensor_parallel: 2",
            entry=ROOT / "tests" / "helpers" / "core_loop.py",
        ),
    )
}


def tracker_says(save: Path) -> str | None:
    """What Megatron-LM's tracker in ``save`` says now (None before the first save)."""
    tracker = save / "latest_checkpointed_iteration.txt"
    return tracker.read_text().strip() if tracker.exists() else None


def _train_variant(variant: Variant, root: Path) -> None:
    """The variant's job into ``root/<name>``, its log beside it and, in ``<name>-events.json``,
    each saved event's iteration with what Megatron-LM's tracker said when it arrived."""
    save = root / variant.name
    events = Receiver(partial(tracker_says, save))
    try:
        run_local_job(
            save,
            nproc=variant.nproc,
            train_iters=variant.train_iters,
            save_interval=variant.save_interval,
            timeout_seconds=600,
            extra=[*variant.switches, "--notify-url", events.url],
            entry=variant.entry,
        )
    finally:
        events.close()
    arrived = zip(events.bodies, events.notes)
    received = [[event["payload"]["iteration"], seen] for body, seen in arrived for event in body]
    (root / f"{variant.name}-events.json").write_text(json.dumps(received))


@pytest.fixture(scope="session")
def variety(tmp_path_factory) -> dict[str, Path]:
    """Save directories of the variants, one checkpoint each (iteration 4), trained once."""
    builds = {f"variant-{name}": partial(_train_variant, variant) for name, variant in VARIANTS.items()}
    return {
        key.removeprefix("variant-"): folder / key.removeprefix("variant-")
        for key, folder in all_once(tmp_path_factory, builds).items()
    }


def saved_events(variety, name: str) -> list[list]:
    """The (iteration, tracker when it arrived) of each saved event the variant's job posted."""
    return json.loads((variety[name].parent / f"{name}-events.json").read_text())


def variant_profile(variety, name: str, tmp_path: Path, **kwargs) -> Path:
    """A profile for a private copy of a variant's save directory, with a local-directory archive."""
    save = shutil.copytree(variety[name], tmp_path / name)
    return write_job_profile(
        tmp_path, save, str(tmp_path / "archive"), layout=VARIANTS[name].layout, **kwargs
    )


@pytest.fixture
def scontrol(tmp_path, monkeypatch) -> Path:
    """Slurm's scontrol stand-in on this host: records its argv in the returned log (a successful
    update, a drain, prints nothing)."""
    folder = tmp_path / "slurm-bin"
    folder.mkdir()
    log = tmp_path / "scontrol.log"
    script = folder / "scontrol"
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> {log}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    return log


@pytest.fixture(scope="session")
def slurm_conf() -> str:
    """The local Slurm cluster (``make slurm``: slurmctld, nodes n1-n3, munge), started if it is
    not running; every node resumed, so a test starts with all three idle."""
    done = subprocess.run(
        [str(ROOT / "infra" / "slurm" / "local_cluster.sh"), "up"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"the local Slurm cluster did not start: {done.stderr or done.stdout}"
    conf = done.stdout.strip().rsplit("=", 1)[-1]
    os.environ["SLURM_CONF"] = conf
    subprocess.run(["scontrol", "update", "NodeName=n[1-3]", "State=RESUME"], capture_output=True, timeout=30)
    return conf


@pytest.fixture(scope="session")
def medium_trained(tmp_path_factory) -> Path:
    """One checkpoint of a wider model (hidden 384, about 20 MB per data file): large enough for
    multipart uploads with 5 MiB parts (s3fs uses them from two parts' worth on)."""
    extra = ["--hidden-size", "384", "--num-attention-heads", "4"]
    return trained_once(tmp_path_factory, train_iters=4, save_interval=4, timeout_seconds=900, extra=extra)


@pytest.fixture
def medium_save_dir(medium_trained, tmp_path) -> Path:
    return shutil.copytree(medium_trained, tmp_path / "medium")
