"""The production recipe (infra/production/) run for real on this machine: PostgreSQL 15 from
Debian's packages in a private cluster, infra/production/postgres.sql applied, the Prefect server
on it with basic auth, a process worker, ``prefect deploy --all --prefect-file
infra/prefect.yaml``, a training.checkpoint.saved event posted with curl, and the server killed
and restarted while the worker runs the flow."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from tasks.checkpoint.layout import HISTORY
from tasks.checkpoint.pointer import PROMOTIONS, read_pointer
from tasks.errors import CkptopsError
from tasks.events import CHECKPOINT_SAVED, job_resource
from tasks.prefect_server import start_server
from tests.conftest import ROOT, free_port
from tests.helpers.poll import until

PG_BIN = Path("/usr/lib/postgresql/15/bin")
AUTH = "admin:ckptops-test"
PASSWORD = "ckptops-db-test"


def as_postgres(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["runuser", "-u", "postgres", "--", *argv], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def postgres():
    """A private PostgreSQL cluster (initdb in a temporary directory), the production SQL applied,
    the role's password set: the database URL. Password authentication over TCP, as in production."""
    if not (PG_BIN / "initdb").exists():
        pytest.fail("PostgreSQL 15 is not installed: `make postgres` installs Debian's package")
    root = Path(tempfile.mkdtemp(prefix="ckptops-pg-"))
    shutil.chown(root, "postgres", "postgres")
    port = free_port()
    made = as_postgres(
        str(PG_BIN / "initdb"), "-D", str(root / "data"), "-U", "postgres",
        "--auth-local=trust", "--auth-host=scram-sha-256",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    started = as_postgres(
        str(PG_BIN / "pg_ctl"), "-D", str(root / "data"), "-l", str(root / "log"), "-w", "-t", "60",
        "-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start",
    )  # fmt: skip
    assert started.returncode == 0, f"PostgreSQL did not start; see {root / 'log'}: {started.stderr}"
    try:
        psql = ["psql", "-h", str(root), "-p", str(port), "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-q"]
        applied = subprocess.run(
            [*psql, "-f", str(ROOT / "infra" / "production" / "postgres.sql")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert applied.returncode == 0, applied.stderr
        # The SQL's placeholder password replaced, as the production README says to.
        changed = subprocess.run(
            [*psql, "-c", f"ALTER ROLE prefect PASSWORD '{PASSWORD}'"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert changed.returncode == 0, changed.stderr
        yield f"postgresql+asyncpg://prefect:{PASSWORD}@127.0.0.1:{port}/prefect"
    finally:
        as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(root / "data"), "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)


class Server:
    """``prefect server start`` on PostgreSQL with basic auth; killable and restartable."""

    def __init__(self, database_url: str, home: Path):
        self.url = f"http://127.0.0.1:{free_port()}/api"
        self.home, self.database_url = home, database_url
        self.process = None

    def start(self) -> "Server":
        self.process = start_server(
            self.url,
            self.home,
            self.home / "server.log",
            timeout_seconds=300,
            env={
                "PREFECT_SERVER_DATABASE_CONNECTION_URL": self.database_url,
                "PREFECT_SERVER_API_AUTH_STRING": AUTH,
            },
        )
        return self

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def client_env(server: Server, profiles: Path) -> dict[str, str]:
    """What a worker host has in /etc/ckptops/prefect-worker.env (and the site's profiles)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_API_URL=server.url,
        PREFECT_API_AUTH_STRING=AUTH,
        PREFECT_HOME=str(server.home / "client"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        CKPTOPS_ROOT=str(ROOT),
        CKPTOPS_PROFILES=str(profiles),
    )
    return env


def prefect(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def post(url: str, body, auth: str | None) -> int:
    """curl, as the training job posts: the status code."""
    argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", "10", "-X", "POST", url]
    argv += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    if auth:
        argv += ["-u", auth]
    return int(subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout)


def saved_event(iteration: int) -> list[dict]:
    return [
        {
            "id": str(uuid.uuid4()),
            "occurred": datetime.now(UTC).isoformat(),
            "event": CHECKPOINT_SAVED,
            "resource": {"prefect.resource.id": job_resource("local-tiny")},
            "payload": {"iteration": iteration},
        }
    ]


def wait_for(predicate, timeout: float, what: str):
    """``until`` through a server restart: a refused connection is "not yet"."""

    def asked():
        try:
            return predicate()
        except (OSError, urllib.error.URLError):
            return None

    return until(asked, timeout, what, every=0.5)


def api(server: Server, path: str, body: dict | None, method: str = "POST"):
    import base64

    request = urllib.request.Request(
        f"{server.url}{path}",
        None if body is None else json.dumps(body).encode(),
        {
            "Content-Type": "application/json",
            "Authorization": "Basic " + base64.b64encode(AUTH.encode()).decode(),
        },
        method=method,
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        content = reply.read()
        return json.loads(content) if content else None


def only_the_trigger_starts_runs(server: Server) -> None:
    """The local-tiny deployment's 30 s poll paused and its scheduled runs deleted: a scheduled
    run that took the deployment's one slot first would wait out the held-back save (300 s) and
    keep the triggered run queued behind it."""
    query = {
        "flows": {"name": {"any_": ["verify-and-promote"]}},
        "deployments": {"name": {"any_": ["local-tiny"]}},
    }
    (deployment,) = api(server, "/deployments/filter", query)
    for schedule in deployment["schedules"]:
        api(server, f"/deployments/{deployment['id']}/schedules/{schedule['id']}", {"active": False}, "PATCH")
    runs = api(server, "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment["id"]]}}})
    for run in runs:
        api(server, f"/flow_runs/{run['id']}", None, "DELETE")


def test_postgres_server_with_auth_and_a_worker_runs_the_triggered_flow_through_a_restart(
    postgres, trained, tmp_path
):
    # The site's profile for the deployments' `profile: local`, pointing at this test's job.
    save = shutil.copytree(trained, tmp_path / "checkpoints")
    metadata = save / "iter_0000024" / "metadata.json"
    held_back = tmp_path / "metadata.json"
    shutil.move(metadata, held_back)  # the newest save still "in progress"
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "local.yaml").write_text(
        yaml.safe_dump(
            {
                "job": {
                    "name": "local-tiny",
                    "save_dir": str(save),
                    "layout": {"data_parallel": 2},
                    "writes_integrity_json": True,
                },
                "verify": {"settle_seconds": 0, "wait_timeout_seconds": 300, "poll_seconds": 1},
                "retention": {"keep_verified": 10},
                "recovery": {"script": str(tmp_path / "job.sh")},
            }
        )
    )
    server = Server(postgres, tmp_path / "prefect").start()
    worker = None
    try:
        env = client_env(server, profiles)
        # Without credentials: refused; health stays open for load balancers.
        assert post(f"{server.url}/flows/filter", {}, None) == 401
        assert post(f"{server.url}/flows/filter", {}, AUTH) == 200
        bad = prefect({**env, "PREFECT_API_AUTH_STRING": "admin:wrong"}, "work-pool", "ls")
        assert bad.returncode != 0 and "401" in bad.stdout + bad.stderr

        created = prefect(env, "work-pool", "create", "ckptops", "--type", "process")
        assert created.returncode == 0, created.stdout + created.stderr
        deployed = prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml")
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        only_the_trigger_starts_runs(server)
        with open(tmp_path / "worker.log", "wb") as log:
            worker = subprocess.Popen(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", "ckptops", "--limit", "4"],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        assert post(f"{server.url}/events", saved_event(24), AUTH) in (200, 201, 202, 204)

        def running_triggered_run():
            runs = api(server, "/flow_runs/filter", {"sort": "EXPECTED_START_TIME_DESC"})
            return [
                r
                for r in runs
                if (r.get("created_by") or {}).get("type") == "AUTOMATION" and r["state_type"] == "RUNNING"
            ]

        run = wait_for(running_triggered_run, 240, "the triggered verify-and-promote run to be RUNNING")[0]
        assert run["parameters"] == {"profile": "local"}

        def waiting_for_the_save():
            tasks = api(server, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})
            return [t for t in tasks if t["name"] == "wait-24" and t["state_type"] == "RUNNING"]

        wait_for(waiting_for_the_save, 240, "the run to wait for the save of iteration 24")
        # Mid-run: the server dies (SIGKILL) and comes back on the same database; meanwhile the
        # save finishes. The worker and the flow run reconnect.
        server.kill()
        shutil.move(held_back, metadata)
        server.start()

        def final_state():
            found = api(server, "/flow_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})
            return (
                found[0]["state_type"]
                if found[0]["state_type"] in ("COMPLETED", "FAILED", "CRASHED")
                else None
            )

        assert wait_for(final_state, 300, "the run's final state") == "COMPLETED"
        assert read_pointer(save) == 24
        # ckptops itself with a wrong auth string: one line naming the setting, exit 2.
        ckptops = [str(Path(sys.executable).with_name("ckptops")), "automations"]
        ckptops += ["--deployment", "recovery-run/local-tiny-recovery", "--profile", "local"]
        wrong = subprocess.run(
            ckptops,
            env={**env, "PREFECT_API_AUTH_STRING": "admin:wrong"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
        assert wrong.stderr.startswith("ckptops: PREFECT_API_AUTH_STRING: ") and "(401)" in wrong.stderr
        right = subprocess.run(ckptops, env=env, capture_output=True, text=True, timeout=120)
        names = [line.split(":")[0] for line in right.stdout.splitlines()]
        assert right.returncode == 0 and names == [
            "ckptops crash silent runs",
            "ckptops crash stuck submissions",
            "ckptops recovery storm local-tiny",
        ], right.stderr
        changes = [json.loads(line) for line in (save / HISTORY / PROMOTIONS).read_text().splitlines()]
        iterations = [c["iteration"] for c in changes]
        assert iterations[-1] == 24 and len(iterations) == len(set(iterations)), changes
    finally:
        if worker is not None:
            os.killpg(worker.pid, signal.SIGKILL)  # and the flow-run processes it started
            worker.wait(timeout=60)
        if server.process is not None and server.process.poll() is None:
            server.kill()


def test_an_unreachable_database_is_the_servers_own_error_with_its_log(tmp_path):
    dead = f"postgresql+asyncpg://prefect:x@127.0.0.1:{free_port()}/prefect"
    with pytest.raises(CkptopsError, match=str(tmp_path / "server.log")):
        Server(dead, tmp_path).start()
    log = (tmp_path / "server.log").read_text()
    assert "Connect call failed" in log or "Connection refused" in log or "connection refused" in log.lower()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not on this host")
def test_the_systemd_units_verify(tmp_path):
    """The units as installed: paths to this checkout's venv, the user that exists here."""
    for unit in ("prefect-server.service", "prefect-worker.service"):
        text = (ROOT / "infra" / "production" / unit).read_text()
        text = text.replace("/opt/ckptops", str(ROOT)).replace("User=ckptops", "User=root")
        text = text.replace("/etc/ckptops/", str(tmp_path) + "/")
        (tmp_path / unit).write_text(text)
        for example in ("prefect-server.env", "prefect-worker.env"):
            shutil.copy(ROOT / "infra" / "production" / f"{example}.example", tmp_path / example)
        done = subprocess.run(
            ["systemd-analyze", "verify", str(tmp_path / unit)], capture_output=True, text=True, timeout=60
        )
        problems = [line for line in done.stderr.splitlines() if unit in line]
        assert done.returncode == 0 and not problems, done.stderr
