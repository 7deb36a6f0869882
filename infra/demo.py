"""``make demo``: the main job on the embedded default (profiles/local.yaml), run the way
production runs it: deployments, a worker, events.

    python -m infra.demo [PROFILE]        the story (a profile with local_job, prefect.home, recovery)
    python -m infra.demo down [PROFILE]   stop the server and the worker the demo started

1. start (or reuse) the local Prefect server, UI on http://127.0.0.1:4200;
2. register the deployments of infra/prefect.yaml (work pool ``ckptops``, schedules and
   triggers as in production) and start (or reuse) a process worker;
3. run the local tiny Megatron-Core job (2 CPU ranks) from its own batch script; it posts
   ``training.checkpoint.saved`` after each save, and the deployment's trigger has the worker
   verify and promote each one. The job was started with a rehearsed GPU failure: rank 1 dies
   with an uncorrectable ECC error before iteration 14;
4. archive the promoted checkpoint, drill a restore from each source, and check node health, each
   as a run of its deployment (no GPU here: the verdict says "no GPUs found");
5. recover the job as a run of the recovery deployment: triage, relaunch of the job's script from
   the promoted checkpoint (hardware is auto-approved in the local profile), progress, validation;
   the resumed job's saves are verified and promoted through the trigger again;
6. report the job's goodput (a run of the goodput-report deployment);
7. print the status table, the incident and where to look in the UI. The server and the worker
   keep running (``make demo-down`` stops them); the next ``make demo`` reuses them.

The demo owns the embedded default's save directory and starts it empty each time, keeping only
the drill history (so repeated demos show a trend); the job's incident ledger starts empty with
the job.
"""

import contextlib
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

from rich.console import Console

from tasks.checkpoint.layout import HISTORY
from tasks.cluster.process import capture, start
from tasks.errors import CkptopsError
from tasks.prefect_server import server_env, start_server
from tasks.profile import PROFILES_ENV, load_profile
from tasks.recovery.ledger import incidents as ledger_incidents
from tasks.recovery.ledger import ledger_path
from tasks.recovery.report import incident_rows

console = Console(highlight=False)
ROOT = Path(__file__).resolve().parent.parent
# Where the demo's job fails: after the save at 12 (rank 1, an uncorrectable ECC error).
FAULT = "1:14:ecc"
POOL = "ckptops"
PREFECT_YAML = ROOT / "infra" / "prefect.yaml"
# The worker asks for work this often (Prefect's default is 10 s): the demo waits on it.
WORKER_POLL_SECONDS = "2"
STOP_GRACE_SECONDS = 10  # demo down: SIGTERM, then SIGKILL after this long


def _ui_url(api_url: str) -> str:
    return api_url.removesuffix("/api").removesuffix("/")


def _alive(pid_file: Path, needle: str) -> int | None:
    """The pid in ``pid_file`` if that process still runs and is what we started."""
    try:
        pid = int(pid_file.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ValueError):
        return None
    return pid if needle in cmdline else None


def _site_profiles(profile) -> dict[str, str]:
    """The deployments say ``profile: local``; a demo of another profile file is made the site's
    ``local`` (a link in a directory the worker searches first)."""
    if profile.source == load_profile("local").source:
        return {}
    site = profile.prefect.home / "profiles"
    site.mkdir(parents=True, exist_ok=True)
    link = site / "local.yaml"
    link.unlink(missing_ok=True)
    link.symlink_to(profile.source)
    return {PROFILES_ENV: str(site)}


def _deployment_digest(env: dict) -> str:
    """What the registered deployments depend on: infra/prefect.yaml, the flows (their
    parameters become the deployments' schemas) and where the worker finds the profiles."""
    digest = hashlib.sha256(PREFECT_YAML.read_bytes())
    for flow in sorted((ROOT / "flows").glob("*.py")):
        digest.update(flow.name.encode() + b"\0" + flow.read_bytes())
    digest.update(env.get(PROFILES_ENV, "").encode())
    return digest.hexdigest()


def _registered() -> bool:
    """Whether the server has the work pool and every deployment of infra/prefect.yaml."""
    import yaml
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    wanted = {d["name"] for d in yaml.safe_load(PREFECT_YAML.read_text())["deployments"]}
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(POOL)
        except ObjectNotFound:
            return False
        return wanted <= {d.name for d in client.read_deployments()}


def _deploy(env: dict, home: Path) -> bool:
    """The work pool and every deployment of infra/prefect.yaml (idempotent: a second demo
    updates them in place); False when the server has them as registered from the same
    prefect.yaml and flows (``deployed.sha256`` in the Prefect home), which are then kept."""
    stamp, digest = home / "deployed.sha256", _deployment_digest(env)
    if stamp.exists() and stamp.read_text() == digest and _registered():
        return False
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process"))
    deploy = [
        sys.executable,
        "-m",
        "prefect",
        "--no-prompt",
        "deploy",
        "--all",
        "--prefect-file",
        "infra/prefect.yaml",
    ]
    deployed = capture(deploy, 300, env, cwd=ROOT)
    if deployed.exit_code != 0:
        raise CkptopsError(f"prefect deploy: {(deployed.stdout + deployed.stderr).strip()[-500:]}")
    stamp.write_text(digest)
    return True


def _worker(home: Path, env: dict) -> tuple[int, bool, list[str]]:
    """Start a process worker for the pool unless ours still runs: its pid, whether it is new, and
    the runs a dead worker had left pending or running, crashed first (they held their
    deployments' slots: every later run of those deployments would wait for them for good)."""
    from tasks.watchdog import crash_orphans

    pid_file = home / "worker.pid"
    pid = _alive(pid_file, "worker start")
    if pid:
        return pid, False, []
    crashed = crash_orphans(POOL, "the demo's worker that ran it is gone (crashed by the next make demo)")
    worker = start(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--limit", "4"],
        home / "worker.log",
        {**env, "PREFECT_WORKER_QUERY_SECONDS": WORKER_POLL_SECONDS},
        ROOT,
        append=True,
    )
    pid_file.write_text(str(worker.pid))
    return worker.pid, True, crashed


def _reset(save_dir: Path) -> None:
    if not save_dir.exists():
        return
    for entry in save_dir.iterdir():
        if entry.name == HISTORY:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    ledger_path(save_dir).unlink(missing_ok=True)


def _wait_promoted(save_dir: Path, iteration: int, timeout: float, status) -> None:
    """Until the triggered verify-and-promote runs have promoted ``iteration``."""
    from tasks.checkpoint.pointer import read_pointer

    deadline = time.monotonic() + timeout
    while read_pointer(save_dir) != iteration:
        if time.monotonic() > deadline:
            raise CkptopsError(
                f"{save_dir}: iteration {iteration} not promoted within {timeout:.0f}s "
                f"(pointer: {read_pointer(save_dir)}); see the verify-and-promote runs in the UI"
            )
        status.update(f"verify-and-promote (triggered by the saves): promoted {read_pointer(save_dir)}")
        time.sleep(0.5)


def _run(name: str, timeout: float, **parameters):
    """A run of a deployment, through the worker, waited for; its final state."""
    from prefect.deployments import run_deployment

    run = run_deployment(name, parameters=parameters, timeout=timeout, poll_interval=1, as_subflow=False)
    return run.state


def main(profile_name: str | None = None) -> int:
    profile = load_profile(profile_name)
    if profile.local_job is None or profile.prefect.home is None or profile.recovery is None:
        raise CkptopsError(f"{profile.source}: the demo needs local_job, prefect.home and recovery sections")
    ui = _serve(profile)
    log, failed_with = _train(profile)
    ok = _scheduled_flows(profile)
    ok = _recover(profile, log, failed_with) and ok
    _summary(profile, ui, log)
    return 0 if ok else 1


def up(profile_name: str | None = None) -> int:
    """Only the services: the server, the deployments, the worker and the watchdog, started or
    reused (after a reboot, say), without training the job again."""
    _serve(load_profile(profile_name))
    return 0


def _serve(profile) -> str:
    """The Prefect server (started or reused), the deployments, a worker and the watchdog."""
    api_url, home = profile.prefect.api_url, profile.prefect.home
    ui = _ui_url(api_url)
    with console.status(f"Prefect server at {ui} (a first start takes about 30 s)..."):
        started = start_server(api_url, home, home / "server.log")
    if started is not None:
        (home / "server.pid").write_text(str(started.pid))
    console.print(
        f"Prefect server: {'started' if started else 'reused'} at {ui} (log: {home / 'server.log'})"
    )
    # Before prefect is imported: this process and its threads are clients of that server.
    os.environ.update(server_env(api_url, home))
    env = {**os.environ, "CKPTOPS_ROOT": str(ROOT), **_site_profiles(profile)}
    with console.status("deployments of infra/prefect.yaml: registering..."):
        deployed = _deploy(env, home)
    pid, new, crashed = _worker(home, env)
    console.print(
        f"deployments {'registered' if deployed else 'up to date'} (work pool {POOL}); "
        f"worker {'started' if new else 'reused'} "
        f"(pid {pid}, log: {home / 'worker.log'})"
    )
    if crashed:
        console.print(f"runs a dead worker had left pending or running, crashed: {', '.join(crashed)}")
    from tasks.watchdog import install

    watching = install(profile)
    console.print(f"watchdog automations: {', '.join(a.name for a in watching)}")
    return ui


def _train(profile) -> tuple[Path, int]:
    """The local job, from scratch, failing as rehearsed; its saves promoted by the worker."""
    from infra.local_job.launch import write_job_script
    from tasks.cluster import process as processes

    job, save_dir, recovery = profile.local_job, profile.job.save_dir, profile.recovery
    _reset(save_dir)
    script = write_job_script(
        recovery.script,
        save_dir,
        recovery.step_records,
        job_name=profile.job.name,
        nodes=job.nproc,
        train_iters=job.train_iters,
        save_interval=job.save_interval,
        notify_url=profile.prefect.api_url,
    )
    recovery.step_records.unlink(missing_ok=True)
    console.print(
        f"training: {job.train_iters} iterations, a checkpoint every {job.save_interval}, "
        f"{job.nproc} CPU ranks -> {save_dir}; rank {FAULT.split(':')[0]} will fail before iteration "
        f"{FAULT.split(':')[1]} ({script})"
    )
    log = recovery.log_dir / "train.out"
    process = processes.start(["bash", str(script)], log, {**os.environ, "CKPTOPS_FAIL_AT": FAULT})
    with console.status("training, posting training.checkpoint.saved after each save..."):
        try:
            processes.wait(process, log, job.timeout_seconds, "the local training job")
        except processes.Failed as e:
            failed_with = e.code
        else:
            raise CkptopsError(f"{log}: the job was to fail at {FAULT} but finished")
    console.print(f"training failed (exit {failed_with}), as rehearsed (log: {log})", markup=False)
    last_save = (int(FAULT.split(":")[1]) - 1) // job.save_interval * job.save_interval
    with console.status("verify-and-promote (triggered by the saves)...") as status:
        _wait_promoted(save_dir, last_save, 300, status)
    console.print(f"verify-and-promote (triggered by the saves, run by the worker): promoted {last_save}")
    return log, failed_with


def _scheduled_flows(profile) -> bool:
    """A run of each scheduled flow's deployment: archive copy, both drills, node health."""
    ok = True
    steps = [("archive-copy/local-tiny-archive", {"force": True}, "archive-copy")]
    steps += [
        (f"restore-drill/local-tiny-drill-{s}", {}, f"restore-drill from {s}") for s in ("shared", "archive")
    ]
    steps += [("node-health/local-health", {}, "node-health")]
    for name, parameters, what in steps:
        with console.status(f"{what}: a run of {name}..."):
            state = _run(name, 900, **parameters)
        console.print(f"{what}: {state.name}: {state.message}", markup=False)
        # On a machine without GPUs node health's FAIL_CONFIG "no GPUs found" is the expected answer.
        ok = ok and (state.is_completed() or what == "node-health")
    return ok


def _recover(profile, log: Path, failed_with: int) -> bool:
    """The recovery run for the rehearsed failure, the relaunched job to its end, its saves
    promoted, and the goodput report."""
    from tasks.recovery.job import wait_ended

    job, save_dir = profile.local_job, profile.job.save_dir
    with console.status("recovery-run: triage, checkpoint, relaunch, progress, validation..."):
        recovered = _run(
            "recovery-run/local-tiny-recovery", 900, logs=[str(log)], exit_code=failed_with, trigger="demo"
        )
    console.print(f"recovery-run: {recovered.name}: {recovered.message}", markup=False)
    incident = ledger_incidents(save_dir)[-1] if ledger_incidents(save_dir) else None
    if incident and incident.relaunched_job:
        with console.status(f"the relaunched job ({incident.relaunched_job}) trains to {job.train_iters}..."):
            wait_ended(incident.relaunched_job, job.timeout_seconds)
        with console.status("verify-and-promote (triggered by the resumed job's saves)...") as status:
            _wait_promoted(save_dir, job.train_iters, 300, status)
        console.print(f"verify-and-promote: the resumed job's saves promoted up to {job.train_iters}")
    with console.status("goodput-report: the ledger and the interval advice..."):
        report = _run("goodput-report/local-tiny-goodput", 300)
    console.print(f"goodput-report: {report.name}: {report.message}", markup=False)
    return recovered.is_completed()


def _summary(profile, ui: str, log: Path) -> None:
    from tasks import render
    from tasks.checkpoint.catalog import catalog
    from tasks.checkpoint.state import VerifyOptions

    save_dir = profile.job.save_dir
    console.print()
    render.status(console, save_dir, catalog(save_dir, VerifyOptions.from_profile(profile)))
    render.incidents(console, profile.job.name, incident_rows(ledger_incidents(save_dir)))
    console.print(
        f"\nPrefect UI: {ui}  (deployments: {ui}/deployments, runs: {ui}/runs, artifacts: {ui}/artifacts)"
    )
    console.print(f"training log: {log}")
    console.print(f"drill history: ckptops drills --profile {profile.source}")
    console.print(f"incidents: ckptops incidents --profile {profile.source}")
    console.print("the server and the worker keep running: make demo-down stops them")


def down(profile_name: str | None = None) -> int:
    """Stop the worker and the server this demo started (by their recorded pids)."""
    import signal

    home = load_profile(profile_name).prefect.home
    for name, needle in (("worker", "worker start"), ("server", "server start")):
        pid_file = home / f"{name}.pid"
        pid = _alive(pid_file, needle)
        if pid:
            os.killpg(pid, signal.SIGTERM)
            # The demo's runs are disposable: a worker waiting for them is killed after a while.
            deadline = time.monotonic() + STOP_GRACE_SECONDS
            while _alive(pid_file, needle) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _alive(pid_file, needle):
                os.killpg(pid, signal.SIGKILL)
            console.print(f"{name}: stopped (pid {pid})")
        else:
            console.print(f"{name}: not running (nothing recorded in {pid_file})")
        pid_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    try:
        if args[:1] in (["down"], ["up"]):
            sys.exit((down if args[0] == "down" else up)(args[1] if len(args) > 1 else None))
        sys.exit(main(args[0] if args else None))
    except CkptopsError as e:
        Console(stderr=True).print(f"demo: {e}", markup=False)
        sys.exit(1)
