"""``make demo``: the main job on the embedded default (profiles/local.yaml), end to end.

    python -m infra.demo [PROFILE]      (a profile with local_job and prefect.home sections)

1. start (or reuse) the local Prefect server, UI on http://127.0.0.1:4200;
2. run the local tiny Megatron-Core job (2 CPU ranks) for a few save intervals, posting a
   ``training.checkpoint.saved`` event to Prefect after each save;
3. run the verify-and-promote flow as each checkpoint lands, and once more at the end;
4. archive the promoted checkpoint and run a restore drill from each source (real restore,
   verification and load), printing each phase's timing;
5. run node health on this machine (no GPU here: the verdict says "no GPUs found");
6. the job was started with a rehearsed GPU failure (rank 1 dies with an uncorrectable ECC
   error): the recovery-run flow triages it, relaunches the job's own script from the promoted
   checkpoint (hardware is auto-approved in the local profile), waits for progress and validates
   the resume; the incident lands in the ledger and the UI;
7. print the status table, the incidents and where to look in the UI.

The demo owns the embedded default's save directory and starts it empty each time, keeping
only the drill history (so repeated demos show a trend); the job's incident ledger starts empty
with the job.
"""

import os
import shutil
import sys
import time

from rich.console import Console

from tasks.checkpoint.layout import HISTORY
from tasks.errors import CkptopsError
from tasks.prefect_server import server_env, start_server
from tasks.profile import load_profile
from tasks.recovery.ledger import incidents as ledger_incidents
from tasks.recovery.ledger import ledger_path
from tasks.recovery.report import incident_rows

console = Console(highlight=False)


def _ui_url(api_url: str) -> str:
    return api_url.removesuffix("/api").removesuffix("/")


# Where the demo's job fails: after the save at 12 (rank 1, an uncorrectable ECC error).
FAULT = "1:14:ecc"


def _training_at(log) -> str:
    """The newest 'iteration N' line of the job's log, for the progress line."""
    try:
        lines = [
            line for line in log.read_text(errors="replace").splitlines() if line.startswith("iteration ")
        ]
    except FileNotFoundError:
        return "starting"
    return f"iteration {lines[-1].split()[1]}" if lines else "starting (torch and megatron imports)"


def _completed_iterations(save_dir, options) -> set[int]:
    from tasks.checkpoint.layout import iter_dir_name, list_iterations
    from tasks.checkpoint.state import completeness

    return {
        i
        for i in list_iterations(save_dir)
        if completeness(save_dir / iter_dir_name(i), options).state is None
    }


def main(profile_name: str | None = None) -> int:
    profile = load_profile(profile_name)
    if profile.local_job is None or profile.prefect.home is None:
        raise CkptopsError(f"{profile.source}: the demo needs local_job and prefect.home sections")
    job, api_url = profile.local_job, profile.prefect.api_url
    home = profile.prefect.home
    with console.status(f"Prefect server at {_ui_url(api_url)} (a first start takes about 30 s)..."):
        started = start_server(api_url, home, home / "server.log")
    console.print(
        f"Prefect server: {'started' if started else 'reused'} at {_ui_url(api_url)}"
        f" (log: {home / 'server.log'})"
    )
    # Before prefect is imported: this process and its threads are clients of that server.
    os.environ.update(server_env(api_url, home))

    from flows.archive_copy import archive_copy
    from flows.node_health import node_health
    from flows.recovery_run import recovery_run
    from flows.restore_drill import restore_drill
    from flows.verify_and_promote import verify_and_promote
    from infra.local_job.launch import write_job_script
    from tasks import render
    from tasks.checkpoint.catalog import catalog
    from tasks.checkpoint.state import VerifyOptions
    from tasks.cluster import process as processes
    from tasks.recovery.job import wait_ended

    save_dir = profile.job.save_dir
    if save_dir.exists():  # a fresh job each time; the drill history is kept, to show a trend
        for entry in save_dir.iterdir():
            if entry.name == HISTORY:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        ledger_path(save_dir).unlink(missing_ok=True)
    recovery = profile.recovery
    script = write_job_script(
        recovery.script,
        save_dir,
        recovery.step_records,
        job_name=profile.job.name,
        nodes=job.nproc,
        train_iters=job.train_iters,
        save_interval=job.save_interval,
        notify_url=api_url,
    )
    recovery.step_records.unlink(missing_ok=True)
    options = VerifyOptions.from_profile(profile)
    console.print(
        f"training: {job.train_iters} iterations, a checkpoint every {job.save_interval}, "
        f"{job.nproc} CPU ranks -> {save_dir}; rank {FAULT.split(':')[0]} will fail before iteration "
        f"{FAULT.split(':')[1]} ({script})"
    )
    log = recovery.log_dir / "train.out"
    process = processes.start(["bash", str(script)], log, {**os.environ, "CKPTOPS_FAIL_AT": FAULT})
    handled: set[int] = set()
    deadline = time.monotonic() + job.timeout_seconds

    def run_flow(why: str):
        state = verify_and_promote(profile=str(profile.source), return_state=True)
        console.print(f"verify-and-promote ({why}): {state.name}: {state.message}", markup=False)
        return state

    with console.status("training: starting") as status:
        while process.poll() is None and time.monotonic() < deadline:
            fresh = _completed_iterations(save_dir, options) - handled
            if fresh:
                status.update(f"verify-and-promote: new checkpoint(s) {sorted(fresh)}")
                run_flow(f"checkpoint(s) {sorted(fresh)} saved")
                handled |= fresh
            else:
                status.update(f"training: {_training_at(log)} of {job.train_iters}")
                time.sleep(0.5)
    try:
        processes.wait(process, log, max(1.0, deadline - time.monotonic()), "the local training job")
    except processes.Failed as e:
        failed_with = e.code
        console.print(
            f"training failed (exit {e.code}), as rehearsed: {processes.tail(log, 1)}", markup=False
        )
    else:
        raise CkptopsError(f"{log}: the job was to fail at {FAULT} but finished")
    with console.status("verify-and-promote: after the failure"):
        state = run_flow("training stopped")

    ok = state.is_completed()
    if profile.archive and profile.drill:
        with console.status("archive-copy: upload, read back, commit..."):
            archived = archive_copy(profile=str(profile.source), force=True, return_state=True)
        console.print(f"archive-copy: {archived.name}: {archived.message}", markup=False)
        for source in ("shared", "archive"):
            with console.status(f"restore-drill from {source}: copy, verify, load (starts 2 ranks)..."):
                drilled = restore_drill(profile=str(profile.source), source=source, return_state=True)
            console.print(f"restore-drill: {drilled.message}", markup=False)
            ok = ok and archived.is_completed() and drilled.is_completed()

    if profile.health:
        with console.status("node-health on this machine..."):
            health = node_health(profile=str(profile.source), return_state=True)
        # On a machine without GPUs a FAIL_CONFIG "no GPUs found" is the expected answer.
        console.print(f"node-health: {health.name}: {health.message}", markup=False)

    with console.status("recovery-run: triage, checkpoint, relaunch, progress, validation..."):
        recovered = recovery_run(
            profile=str(profile.source),
            logs=[str(log)],
            exit_code=failed_with,
            trigger="demo",
            return_state=True,
        )
    console.print(f"recovery-run: {recovered.name}: {recovered.message}", markup=False)
    ok = ok and recovered.is_completed()
    relaunched = ledger_incidents(save_dir)[-1].relaunched_job
    if relaunched:
        with console.status(f"the relaunched job ({relaunched}) trains to iteration {job.train_iters}..."):
            wait_ended(relaunched, job.timeout_seconds)
        with console.status("verify-and-promote: after the resumed run"):
            state = run_flow("resumed run finished")
        ok = ok and state.is_completed()

    console.print()
    render.status(console, save_dir, catalog(save_dir, options))
    render.incidents(console, profile.job.name, incident_rows(ledger_incidents(save_dir)))
    ui = _ui_url(api_url)
    console.print(f"\nPrefect UI: {ui}  (flow runs: {ui}/runs, artifacts: {ui}/artifacts)")
    console.print(f"training log: {log}")
    console.print(f"drill history: ckptops drills --profile {profile.source}")
    console.print(f"incidents: ckptops incidents --profile {profile.source}")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
    except CkptopsError as e:
        Console(stderr=True).print(f"demo: {e}", markup=False)
        sys.exit(1)
