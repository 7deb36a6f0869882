"""Profiles: one schema, clear errors naming the file and the key."""

from typing import get_args

import pytest

from tasks.errors import UsageError
from tasks.health.run import CHECKS
from tasks.health.verdict import NodeCheck
from tasks.profile import PROFILES_DIR, Health, load_profile


def test_embedded_default_resolves_paths_inside_the_project():
    profile = load_profile()
    assert profile.job.name == "local-tiny"
    assert profile.job.save_dir == (PROFILES_DIR.parent / "data" / "local" / "checkpoints").resolve()
    assert profile.retention.keep_verified == 3
    assert profile.prefect.api_url == "http://127.0.0.1:4200/api"
    assert profile.local_job.nproc == profile.job.layout.world_size == 2


def test_production_example_describes_the_500b_job():
    profile = load_profile("example-500b")
    assert profile.job.layout.world_size == 5120
    assert (
        profile.job.layout.tensor_parallel,
        profile.job.layout.pipeline_parallel,
        profile.job.layout.data_parallel,
    ) == (8, 8, 80)
    assert profile.retention.keep_verified == 3 and profile.local_job is None
    assert profile.verify.engine == "slurm" and profile.verify.slurm.nodes == 64
    # Fleet conformance: opt-in by the checks list, pins compared as the schema reads them.
    conformance = profile.health.conformance
    assert "conformance" in profile.health.checks and "conformance" not in load_profile().health.checks
    assert conformance.pins == {"power_limit_w": 700.0} and conformance.spares == "refuse"
    assert conformance.nccl_command[0] == "/shared/gpt-500b/venv/bin/python"


_HEALTH = "job: {name: j, save_dir: /x}\nhealth: {nodes: [a], transport: local, raw_dir: /x, "


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "job: {name: j, save_dir: /x}\nretention: {keep_verified: 1}\n",
            "retention.keep_verified: Input should be greater than or equal to 2",
        ),
        (
            "job: {name: j, save_dir: /x}\nretention: {keep_verfied: 3}\n",
            "retention.keep_verfied: Extra inputs are not permitted",
        ),
        ("job: {name: Bad Name, save_dir: /x}\n", "job.name: String should match pattern"),
        (
            "job: {name: j, save_dir: /x}\nverify: {engine: spark}\n",
            "verify.engine: Input should be 'local' or 'slurm'",
        ),
        (
            "job: {name: j, save_dir: /x}\nverify: {slurm: {time_limit: 'an hour'}}\n",
            "verify.slurm.time_limit: String should match pattern",
        ),
        ("job: {save_dir: /x}\n", "job.name: Field required"),
        (
            "job: {name: j, save_dir: /x}\nverify: {threads: many}\n",
            "verify.threads: Input should be a valid integer",
        ),
        ("- just\n- a list\n", "a profile must be a mapping"),
        ("job: [a, b]\n", "job: Input should be a valid dictionary"),
        ("job: {name: j, save_dir: /x}\nprefect: 5\n", "prefect: Input should be a valid dictionary"),
        ("job: {name: j\n", "profile is not YAML at line 2"),
        (
            "job: {name: j, save_dir: /x}\nrecovery: {script: /x.sh, reverify: 'off'}\n",
            "recovery.reverify: Input should be 'full' or 'manifest'",
        ),
        (
            "job: {name: j, save_dir: /x}\nverify: {alert_after_seconds: 5}\n",
            "verify.alert_after_seconds: Input should be greater than or equal to 10",
        ),
        (
            f"{_HEALTH}conformance: {{pins: {{nccl: '2.21.5'}}}}}}\n",
            "health.conformance: Value error, pins.nccl needs nccl_command",
        ),
        (
            f"{_HEALTH}conformance: {{pins: {{bios: '1.2'}}}}}}\n",
            "health.conformance.pins.bios.[key]: Input should be 'driver', 'cuda', 'nccl'",
        ),
        (
            f"{_HEALTH}conformance: {{spares: admit}}}}\n",
            "health.conformance.spares: Input should be 'refuse' or 'warn'",
        ),
        (
            f"{_HEALTH}checks: [gpu-count, ssh]}}\n",
            "health.checks.1: Input should be 'gpu-count', 'gpu-processes', 'recovery-action'",
        ),
        (
            "job: {name: j, save_dir: /x}\nrecovery: {script: /x.sh, auto_approve: [hardware, gremlins]}\n",
            "recovery.auto_approve.1: Input should be 'hardware', 'network', 'numerics'",
        ),
        (
            "job: {name: j, save_dir: /x}\nverify: {digest: md5}\n",
            "verify.digest: Input should be 'xxh3', 'blake3' or 'sha256'",
        ),
    ],
)
def test_bad_values_name_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as caught:
        load_profile(path)
    assert str(caught.value).startswith(f"{path}:") and message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_checks_a_profile_may_list_are_those_run_on_a_node():
    """health.checks' words are health's own: every check run on a node, and only those; by
    default all but conformance, in the order they run."""
    assert set(get_args(NodeCheck)) == set(CHECKS)
    default = Health(nodes=["a"], transport="local", raw_dir="/x").checks
    assert default == [c for c in get_args(NodeCheck) if c != "conformance"]


def test_missing_profile_is_named_with_where_a_name_is_looked_up(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="nope.yaml: profile not found") as caught:
        load_profile("nope")
    assert "a name is looked up in $CKPTOPS_PROFILES" in str(caught.value)
    # A file of that name in this directory is not taken for the name, but pointed at.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("job: {name: mine, save_dir: .}\n")
    with pytest.raises(UsageError, match="for the file in this directory give -p ./mine.yaml"):
        load_profile("mine")


def test_unreadable_profiles_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match=f"{tmp_path}: cannot read the profile"):
        load_profile(tmp_path / "")  # a directory
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"job: \xff\xfe\x00")
    with pytest.raises(UsageError, match="binary.yaml"):
        load_profile(binary)
