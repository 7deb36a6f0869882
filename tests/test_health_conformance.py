"""Fleet conformance against real OpenSSH servers on 127.0.0.x whose tools replay recorded
outputs (tests/helpers/cluster.py): the fleet's majority, a spare's admission against the
fleet's recorded facts, and a slower resume naming the relaunched node that differs."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.health.history import describe, latest_facts, read_history, record_facts
from tasks.health.run import run_health
from tasks.health.sweep import sweep
from tasks.outcome import Verdict
from tasks.profile import load_profile
from tasks.recovery.phases import relaunched_facts, spare_note
from tests.conftest import free_port
from tests.helpers.cluster import FakeCluster, profile_yaml, r3_pass_document

FLEET = ["127.0.0.21", "127.0.0.22", "127.0.0.23", "127.0.0.24"]
OLD_DRIVER = FLEET[3]  # the odd one out: another driver (synthetic, from the recorded query)
SPARE_OK, SPARE_OLD = "127.0.0.25", "127.0.0.26"
OLD_QUERY = "synthetic_nvidia_smi_query_gpu_8xH100_driver_570.csv"
DATA = Path(__file__).parent / "data" / "health"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    fake = FakeCluster(tmp_path_factory.mktemp("cluster"), FLEET + [SPARE_OK, SPARE_OLD], free_port()).start()
    fake.record("default", "diag", r3_pass_document())  # what the spare admission set runs
    for node in (OLD_DRIVER, SPARE_OLD):
        fake.record_sample(node, "gpu-facts", OLD_QUERY)
    yield fake
    fake.stop()


def make_profile(cluster, tmp_path, nodes, **extra):
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "health.yaml"
    known_hosts = cluster.known_hosts(tmp_path / "known_hosts")
    path.write_text(profile_yaml(cluster, nodes, known_hosts, tmp_path / "raw", **extra))
    return load_profile(path)


def test_the_node_that_differs_from_the_fleet_majority_alone_fails_naming_the_fact(cluster, tmp_path):
    profile = make_profile(cluster, tmp_path, FLEET, checks=["conformance"])
    run = run_health(profile.health, FLEET)
    got = {r.node: r for r in run.reports}
    for node in FLEET[:3]:
        assert got[node].verdict is Verdict.PASS, got[node].summary
    odd = got[OLD_DRIVER]
    assert odd.verdict is Verdict.FAIL_CONFIG
    assert odd.summary == "conformance: driver 570.124.06, expected 580.126.20 (3 of 4 nodes)"
    # Every node's facts are kept in its history, and the verdict line says what the fleet found.
    raw = profile.health.raw_dir
    assert latest_facts(raw, OLD_DRIVER)["driver"] == "570.124.06"
    assert latest_facts(raw, FLEET[0]) == got[FLEET[0]].facts and got[FLEET[0]].facts["cuda"] == "12.7"
    verdicts = [e for e in read_history(raw, OLD_DRIVER) if e.get("kind") == "verdict"]
    assert [v["verdict"] for v in verdicts] == ["FAIL_CONFIG"]
    assert (
        describe(read_history(raw, OLD_DRIVER)[0])
        .split(None, 1)[1]
        .startswith("facts     driver 570.124.06, cuda")
    )

    # A recovery checks only its suspects: the rest of the fleet counts by its recorded facts.
    (suspect,) = run_health(profile.health, [OLD_DRIVER]).reports
    assert suspect.summary == "conformance: driver 570.124.06, expected 580.126.20 (3 of 4 nodes)"
    (healthy,) = run_health(profile.health, [FLEET[0]]).reports
    assert healthy.verdict is Verdict.PASS

    # Two against two: no majority, nothing fails, and the check says so.
    pair = [FLEET[0], OLD_DRIVER]
    tie = run_health(make_profile(cluster, tmp_path / "tie", pair, checks=["conformance"]).health, pair)
    for report in tie.reports:
        assert report.verdict is Verdict.PASS
        assert "(no majority for driver (at most 1 of 2 nodes agree))" in report.checks[0].detail
    alone = run_health(
        make_profile(cluster, tmp_path / "one", [OLD_DRIVER], checks=["conformance"]).health, [OLD_DRIVER]
    )
    assert alone.reports[0].verdict is Verdict.PASS
    assert alone.reports[0].checks[0].detail.endswith("(no fleet majority: 1 node with facts)")


def _admit(cluster, tmp_path, policy: str):
    """Record the fleet's facts with a run of the fleet, then run the admission set on both
    spares (r3, NCCL, the pair test against a fleet node, conformance)."""
    checks = ["gpu-count", "dcgm-diag", "nccl", "conformance"]
    extra = dict(
        checks=checks,
        spares=[SPARE_OK, SPARE_OLD],
        pairs={"known_good": FLEET[0]},
        drain={"enabled": False},
        conformance={"spares": policy},
    )
    profile = make_profile(cluster, tmp_path, FLEET[:3], **extra)
    run_health(profile.health, FLEET[:3])
    return sweep(profile.health, [SPARE_OK, SPARE_OLD], admit=True)


def test_a_spare_that_differs_from_the_fleets_recorded_facts_is_refused(cluster, tmp_path):
    done = _admit(cluster, tmp_path, "refuse")
    got = {r.node: r for r in done.run.reports}
    assert got[SPARE_OK].verdict is Verdict.PASS and done.spares[SPARE_OK] == "ready"
    assert got[SPARE_OLD].verdict is Verdict.FAIL_CONFIG
    why = (
        "conformance: driver 570.124.06, expected 580.126.20 (3 of 3 recorded nodes) "
        "(not admitted: health.conformance.spares is refuse)"
    )
    assert done.spares[SPARE_OLD] == f"not ready: {why}"
    assert spare_note(done) == f"; spare {SPARE_OLD} not ready: {why}"  # what the approver reads


def test_a_spare_that_differs_is_admitted_with_a_warning_when_the_profile_says_warn(cluster, tmp_path):
    done = _admit(cluster, tmp_path, "warn")
    got = {r.node: r for r in done.run.reports}
    assert got[SPARE_OLD].verdict is Verdict.WARN and done.spares[SPARE_OLD] == "ready"
    assert got[SPARE_OLD].summary == (
        "conformance: driver 570.124.06, expected 580.126.20 (3 of 3 recorded nodes) "
        "(admitted with a warning: health.conformance.spares is warn)"
    )
    assert got[SPARE_OK].verdict is Verdict.PASS


def test_a_slower_resume_names_the_relaunched_node_that_differs(tmp_path, monkeypatch):
    """The relaunched Slurm job's nodes (scontrol stand-in), their recorded facts (read from the
    recordings), and the throughput check of a resumed run that is far below its baseline."""
    from tasks.health.checks.conformance import gpu_facts, gpu_rows
    from tasks.job.step_records import load_steps
    from tasks.resume.checks import Validator

    raw = tmp_path / "raw"
    recorded = "nvidia_smi_query_gpu_8xH100_driver_power_clocks.csv"
    for node, sample in (("gpu1", recorded), ("gpu2", recorded), ("gpu3", OLD_QUERY)):
        record_facts(raw, node, gpu_facts(gpu_rows((DATA / sample).read_text()))[0])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(
        '#!/bin/sh\ncase "$2" in\n'
        "  job) echo 'JobId=4242 JobName=pretrain JobState=RUNNING NodeList=gpu[1-4] NumTasks=32';;\n"
        "  hostnames) printf 'gpu1\\ngpu2\\ngpu3\\ngpu4\\n';;\nesac\n"
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    health = SimpleNamespace(raw_dir=raw, conformance=SimpleNamespace(max_age_days=7))
    profile = SimpleNamespace(health=health, recovery=SimpleNamespace(launcher="slurm"))
    relaunched = relaunched_facts(profile, "4242")
    assert sorted(relaunched) == ["gpu1", "gpu2", "gpu3", "gpu4"] and relaunched["gpu4"] is None

    after = load_steps(Path(__file__).parent / "data" / "megatron" / "megatron_llm_issue11.log")
    facts = SimpleNamespace(iteration=int(after.iteration[0]) - 1, seq_length=None, directory=tmp_path)
    settings = SimpleNamespace(warmup_steps=0, min_steps=1, throughput_drop=0.05)

    def throughput(baseline: float, nodes):
        baseline = {"throughput_median": baseline, "throughput_unit": after.throughput_unit}
        validator = Validator(facts, None, after, settings, baseline, relaunched=nodes)
        validator._throughput()
        return validator.result.checks[-1]

    slow = throughput(100.0, relaunched)  # the log's run makes about 11.6 samples/s
    assert slow.outcome == "fail"
    assert slow.detail == (
        "relaunched nodes that differ from the rest: gpu3: driver 570.124.06, expected 580.126.20 "
        "(2 of 3 relaunched nodes); no conformance facts recorded for gpu4"
    )
    same = {n: f for n, f in relaunched.items() if n != "gpu3"}
    assert throughput(100.0, same).detail == (
        "none of the 2 relaunched nodes with recorded facts differs from the rest; "
        "no conformance facts recorded for gpu4"
    )
    assert (
        throughput(100.0, {"gpu4": None}).detail
        == "no conformance facts recorded for the relaunched nodes (gpu4)"
    )
    # Throughput as before: nothing to explain.
    assert throughput(11.0, relaunched).outcome == "pass" and throughput(11.0, relaunched).detail == ""


def test_recorded_facts_older_than_max_age_are_not_compared(tmp_path):
    """After a fleet-wide upgrade, nodes not checked since would outvote the upgraded ones."""
    from datetime import UTC, datetime, timedelta

    record_facts(tmp_path, "n1", {"driver": "570.124.06"}, now=datetime.now(UTC) - timedelta(days=8))
    assert latest_facts(tmp_path, "n1") == {"driver": "570.124.06"}
    assert latest_facts(tmp_path, "n1", max_age_days=7) is None
    record_facts(tmp_path, "n1", {"driver": "580.126.20"})
    assert latest_facts(tmp_path, "n1", max_age_days=7) == {"driver": "580.126.20"}
