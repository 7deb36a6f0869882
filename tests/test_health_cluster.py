"""The node-health fan-out against real OpenSSH servers on 127.0.0.x, whose GPU tools are
stand-ins replaying recorded outputs (tests/helpers/cluster.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.errors import UsageError
from tasks.health.actions import apply_drains, plan_drains, spare_readiness
from tasks.health.run import resolve_nodes, run_health
from tasks.outcome import Verdict
from tasks.profile import load_profile
from tests.conftest import ROOT, free_port
from tests.helpers.cluster import STANDIN, FakeCluster, profile_yaml, r3_pass_document
from tests.helpers.poll import until

HEALTHY = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
FAILING_GPU, HANGS, KEY_CHANGED, KEY_UNKNOWN = "127.0.0.5", "127.0.0.6", "127.0.0.7", "127.0.0.8"
PERSISTENCE, SLOW_NCCL, XID = "127.0.0.9", "127.0.0.10", "127.0.0.11"
UNREACHABLE = "127.0.0.250"  # nothing listens there
NODES = HEALTHY + [FAILING_GPU, HANGS, KEY_CHANGED, KEY_UNKNOWN, PERSISTENCE, SLOW_NCCL, XID, UNREACHABLE]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    listening = [n for n in NODES if n != UNREACHABLE]
    fake = FakeCluster(root, listening, free_port()).start()
    fake.record_sample(FAILING_GPU, "diag", "synthetic_dcgm4_diag_r2_isolate.json", rc=205)
    fake.record(HANGS, "diag", "", sleep=30)
    fake.record_sample(PERSISTENCE, "diag", "dcgm4_diag_r1_gb10_fail.json", rc=226)
    fake.record_sample(SLOW_NCCL, "nccl", "nccl_allreduce_2node_16xH100_gcp_a3mega.txt")
    fake.record_sample(XID, "journal", "synthetic_journal_xid79.txt")
    yield fake
    fake.stop()


def make_profile(cluster, tmp_path, nodes=NODES, **extra):
    known_hosts = cluster.known_hosts(
        tmp_path / "known_hosts", wrong_key_for=(KEY_CHANGED,), missing=(KEY_UNKNOWN,)
    )
    path = tmp_path / "health.yaml"
    path.write_text(profile_yaml(cluster, nodes, known_hosts, tmp_path / "raw", **extra))
    return load_profile(path)


def test_fan_out_gives_each_node_its_verdict_and_drains_within_the_cap(cluster, tmp_path, scontrol):
    profile = make_profile(cluster, tmp_path)
    run = run_health(profile.health, NODES)
    got = {r.node: r for r in run.reports}
    for node in HEALTHY:
        assert got[node].verdict is Verdict.PASS, got[node].summary
    assert got[FAILING_GPU].verdict is Verdict.FAIL_HARDWARE
    evidence = got[FAILING_GPU].worst_check.evidence[0]
    assert (evidence.test, evidence.gpu, evidence.error_id, evidence.severity) == ("memory", 3, 83, "ISOLATE")
    assert (
        got[HANGS].verdict is Verdict.SUSPECT
        and "timed out" in got[HANGS].summary
        and "again after a retry" in got[HANGS].summary
    )
    assert got[KEY_CHANGED].verdict is Verdict.TOOL_ERROR and "host key changed" in got[KEY_CHANGED].summary
    assert "refused" in got[KEY_CHANGED].summary
    assert (
        got[KEY_UNKNOWN].verdict is Verdict.TOOL_ERROR
        and "host key unknown, refused" in got[KEY_UNKNOWN].summary
    )
    assert got[UNREACHABLE].verdict is Verdict.SUSPECT and "unreachable" in got[UNREACHABLE].summary
    assert got[PERSISTENCE].verdict is Verdict.FAIL_CONFIG and "error 29 (CONFIG)" in got[PERSISTENCE].summary
    assert (
        got[SLOW_NCCL].verdict is Verdict.FAIL_HARDWARE
        and got[SLOW_NCCL].worst_check.evidence[0].value == 338.82
    )
    assert (
        got[SLOW_NCCL].worst_check.attempts == 2 and "again after a retry" in got[SLOW_NCCL].summary
    )  # measured twice
    assert got[XID].verdict is Verdict.FAIL_HARDWARE and "critical XID 79" in got[XID].summary
    # A node without a host key we trust was never sent a command.
    assert not [c for c in cluster.calls() if c["address"] in (KEY_CHANGED, KEY_UNKNOWN)]

    plan = apply_drains(plan_drains(run.reports, profile.health), profile.health)
    assert plan.page is None
    assert [n for n, _ in plan.drain] == plan.drained == [FAILING_GPU, SLOW_NCCL]  # hardware first, cap 2
    assert {n for n, _ in plan.held} == {PERSISTENCE, XID}
    assert sorted(plan.rerun) == sorted([HANGS, KEY_CHANGED, KEY_UNKNOWN, UNREACHABLE])
    drains = scontrol.read_text().splitlines()
    assert drains[0].startswith(
        f"update NodeName={FAILING_GPU} State=DRAIN Reason=ckptops FAIL_HARDWARE dcgm-diag: memory on GPU 3"
    )
    assert len(drains) == 2

    # The next run drains the next two, the hourly cap (4) then stops a third; drained nodes are
    # never drained twice.
    second = apply_drains(plan_drains(run.reports, profile.health), profile.health)
    assert second.drained == [XID, PERSISTENCE]
    third = plan_drains(run.reports, profile.health)
    assert third.drain == [] and {why for _, why in third.held} == {"already drained within the hour"}
    assert len(scontrol.read_text().splitlines()) == 4


def test_raw_outputs_and_history_are_kept_per_node(cluster, tmp_path, scontrol):
    profile = make_profile(cluster, tmp_path, nodes=[HEALTHY[0]])
    first = run_health(profile.health, [HEALTHY[0]]).reports[0]
    raw = Path(first.checks[0].raw)
    assert raw.parent == tmp_path / "raw" / HEALTHY[0] and raw.read_text().startswith(
        "$ dcgmi discovery -l\n# exit: 0"
    )
    run_health(profile.health, [HEALTHY[0]])
    history = (tmp_path / "raw" / HEALTHY[0] / "history.jsonl").read_text().splitlines()
    assert len(history) == 2 and json.loads(history[0])["verdict"] == "PASS"
    from datetime import datetime

    first_run = int(datetime.fromisoformat(json.loads(history[0])["started_at"]).timestamp())
    journal_calls = [
        c["argv"] for c in cluster.calls() if c["address"] == HEALTHY[0] and c["tool"] == "journalctl"
    ]
    assert (
        journal_calls[-1][-1] == f"--since=@{first_run}"
    )  # the second run reads the log from the first's start


def test_one_connection_per_node_and_parameters_never_reach_a_shell(cluster, tmp_path, scontrol):
    marker = tmp_path / "injected"
    profile = make_profile(
        cluster,
        tmp_path,
        nodes=[HEALTHY[1]],
        # Room for a loaded machine: a diag that timed out would be retried, a ninth command.
        diag_timeout_seconds={1: 10},
        nccl={
            "command": [
                "all_reduce_perf",
                "-b",
                "1G",
                "-e",
                "8G",
                "-g",
                "8",
                f"$(touch {marker})",
                "; touch " + str(marker),
            ]
        },
    )
    before, connected = len(cluster.calls()), cluster.connections(HEALTHY[1])
    run_health(profile.health, [HEALTHY[1]])
    calls = [c for c in cluster.calls()[before:] if c["address"] == HEALTHY[1]]
    assert len(calls) == len(profile.health.checks) == 8  # every check (one command each)
    assert len({c["client_port"] for c in calls}) == 1  # on one connection
    assert cluster.connections(HEALTHY[1]) - connected == 1  # and no other connection opened, used or not
    nccl = [c["argv"] for c in calls if c["tool"] == "all_reduce_perf"][-1]
    assert nccl[-2:] == [f"$(touch {marker})", f"; touch {marker}"]  # arrived as literal arguments
    assert not marker.exists()
    with pytest.raises(UsageError, match="only letters, digits"):
        resolve_nodes(profile.health, ["node1;reboot"])


def test_many_nodes_failing_one_check_stop_and_page(cluster, tmp_path, scontrol):
    for node in HEALTHY:
        cluster.record_sample(node, "diag", "synthetic_dcgm4_diag_r2_isolate.json", rc=205)
    try:
        profile = make_profile(cluster, tmp_path, nodes=HEALTHY)
        run = run_health(profile.health, HEALTHY)
    finally:
        for node in HEALTHY:
            for suffix in ("out", "rc"):
                (cluster.root / "scenarios" / node / f"diag.{suffix}").unlink()
    plan = apply_drains(plan_drains(run.reports, profile.health), profile.health)
    assert plan.page.startswith("3 nodes fail dcgm-diag at once") and plan.drained == []
    assert not scontrol.exists()


def test_draining_off_gives_a_plan_only(cluster, tmp_path, scontrol):
    profile = make_profile(cluster, tmp_path, nodes=[FAILING_GPU], drain={"enabled": False})
    run = run_health(profile.health, [FAILING_GPU])
    plan = apply_drains(plan_drains(run.reports, profile.health), profile.health)
    assert [n for n, _ in plan.drain] == [FAILING_GPU] and plan.drained == []
    assert not scontrol.exists()


def test_spare_admission_needs_r3_nccl_and_a_pair_test(cluster, tmp_path, scontrol):
    cluster.record("default", "diag", r3_pass_document())
    cluster.record_sample(
        HEALTHY[2], "pair", "nccl_allreduce_2node_init_failure_ncclwarn_issue294_excerpt.txt", rc=3
    )
    try:
        spares = [HEALTHY[1], HEALTHY[2]]
        profile = make_profile(
            cluster, tmp_path, nodes=spares, pairs={"enabled": False, "known_good": HEALTHY[0]}
        )
        run = run_health(profile.health, spares, admit=True)
    finally:
        cluster.record_sample("default", "diag", "synthetic_dcgm4_diag_r1_pass.json")
        for suffix in ("out", "rc"):
            (cluster.root / "scenarios" / HEALTHY[2] / f"pair.{suffix}").unlink()
    assert run.level == 3
    readiness = spare_readiness(run.reports, spares, run.level)
    assert set(spare_readiness(run.reports, spares, 1).values()) == {
        "not ready: the admission set did not run completely"
    }
    assert readiness[HEALTHY[1]] == "ready"
    assert readiness[HEALTHY[2]].startswith(f"not ready: nccl-pair-{HEALTHY[0]}: the test could not run")
    pair = [c["argv"] for c in cluster.calls() if c["tool"] == "mpirun" and c["address"] == HEALTHY[1]][-1]
    assert f"{HEALTHY[1]}:8,{HEALTHY[0]}:8" in pair and "NCCL_ALGO=Ring" in pair


def test_a_node_failing_its_pair_test_is_recorded_failing_once(cluster, tmp_path, scontrol):
    """Conformance off: the node's verdict goes to its history once, after the pair test too."""
    node, good = HEALTHY[1], HEALTHY[0]
    cluster.record_sample(node, "pair", "nccl_allreduce_2node_16xH100_gcp_a3mega.txt")
    try:
        profile = make_profile(cluster, tmp_path, nodes=[node], pairs={"enabled": True, "known_good": good})
        (report,) = run_health(profile.health, [node]).reports
    finally:
        for suffix in ("out", "rc"):
            (cluster.root / "scenarios" / node / f"pair.{suffix}").unlink()
    assert report.verdict is Verdict.FAIL_HARDWARE and report.worst_check.name == f"nccl-pair-{good}"
    history = [
        json.loads(line) for line in (tmp_path / "raw" / node / "history.jsonl").read_text().splitlines()
    ]
    verdicts = [entry for entry in history if entry["kind"] == "verdict"]
    assert [v["verdict"] for v in verdicts] == ["FAIL_HARDWARE"], verdicts
    assert verdicts[0]["checks"][-1]["check"] == f"nccl-pair-{good}"


def test_health_cli_json_and_exit_code(cluster, tmp_path, scontrol):
    profile = make_profile(cluster, tmp_path, drain={"enabled": False})
    done = subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "ckptops"),
            "health",
            "run",
            "--profile",
            str(profile.source),
            "--nodes",
            f"{HEALTHY[0]},{PERSISTENCE}",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ,
    )
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert {n["node"]: n["verdict"] for n in data["nodes"]} == {
        HEALTHY[0]: "PASS",
        PERSISTENCE: "FAIL_CONFIG",
    }
    assert data["drain"][0][0] == PERSISTENCE and data["drained"] == []


def test_key_from_a_prefect_secret_block_and_the_node_health_flow(cluster, tmp_path, scontrol, prefect_api):
    """The SSH key lives in a Prefect Secret block (not on disk in the profile); the flow checks
    the nodes, drains within the cap and publishes the per-node table worst first."""
    from prefect.artifacts import Artifact
    from prefect.blocks.system import Secret

    from flows.node_health import node_health

    Secret(value=cluster.client_key.read_text()).save("health-test-ssh-key", overwrite=True)
    nodes = [HEALTHY[0], FAILING_GPU, PERSISTENCE]
    profile = make_profile(
        cluster, tmp_path, nodes=nodes, ssh={"key_file": None, "secret_block": "health-test-ssh-key"}
    )
    state = node_health(profile=str(profile.source), return_state=True)
    assert state.is_failed() and state.message.startswith("3 nodes: FAIL_CONFIG 1, FAIL_HARDWARE 1, PASS 1")
    rows = json.loads(Artifact.get("node-health").data)
    assert [(r["node"], r["verdict"]) for r in rows] == [
        (FAILING_GPU, "FAIL_HARDWARE"),
        (PERSISTENCE, "FAIL_CONFIG"),
        (HEALTHY[0], "PASS"),
    ]
    assert rows[0]["error id"] == 83 and rows[0]["severity"] == "ISOLATE" and rows[0]["raw"]
    actions = Artifact.get("node-health-actions").data
    assert f"drained: {FAILING_GPU}" in actions and len(scontrol.read_text().splitlines()) == 2


def test_each_node_is_connected_once_and_a_failed_retry_stays_that_nodes(tmp_path, monkeypatch):
    """Hosts that count their connections (a module-internal stand-in for the transport): a node
    refused twice is SUSPECT, and the fleet's other nodes are checked on one connection each."""
    from tasks.cluster.process import Output
    from tasks.cluster.transport import Unreachable
    from tasks.health import run as health_run

    opened = []

    class Host:
        def __init__(self, node, *_):
            self.node = node

        def open(self):
            opened.append(self.node)
            if self.node == "refusing":
                raise Unreachable(f"{self.node}: unreachable (Connection refused)")
            return self

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, argv, timeout):
            return Output(argv, 0, "8 GPUs found.\n", "", 0.01)

    monkeypatch.setattr(health_run, "_host", Host)
    path = tmp_path / "health.yaml"
    path.write_text(
        f"job: {{name: t, save_dir: '{tmp_path}'}}\n"
        f"health: {{nodes: [a, refusing, b], transport: local, raw_dir: '{tmp_path / 'raw'}', "
        "checks: [gpu-count]}\n"
    )
    run = run_health(load_profile(path).health, ["a", "refusing", "b"])
    verdicts = {r.node: r.verdict for r in run.reports}
    assert verdicts == {"a": Verdict.PASS, "refusing": Verdict.SUSPECT, "b": Verdict.PASS}
    assert sorted(opened) == ["a", "b", "refusing", "refusing"]


def test_a_cluster_that_stops_ends_its_own_hanging_stand_ins_not_another_clusters(tmp_path):
    """Each xdist worker has its fake cluster, and their stand-ins run one script: stopping one
    cluster must leave a check in flight on another alone (it was killed, and its node answered
    with a signal instead of its recording)."""

    def hanging(cluster: FakeCluster) -> subprocess.Popen:
        cluster.record("default", "diag", "done\n", sleep=60)
        env = {"STANDIN_ROOT": str(cluster.root), "PATH": os.environ["PATH"]}
        return subprocess.Popen([sys.executable, "-I", "-S", str(STANDIN), "dcgmi", "diag"], env=env)

    mine, theirs = FakeCluster(tmp_path / "mine", [], 0), FakeCluster(tmp_path / "theirs", [], 0)
    in_flight, other = hanging(mine), hanging(theirs)
    try:
        until(lambda: (tmp_path / "theirs" / "calls.log").exists(), 30, "the other stand-in started")
        until(lambda: (tmp_path / "mine" / "calls.log").exists(), 30, "this stand-in started")
        mine.stop()
        assert in_flight.wait(timeout=30) < 0  # ended by a signal
        assert other.poll() is None, "stopping one cluster killed another cluster's check in flight"
    finally:
        other.kill()
        other.wait()
