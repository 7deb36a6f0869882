"""``make demo`` end to end, on a profile of its own that points at the test Prefect server."""

import os
import subprocess
import sys

import pytest

from tasks.checkpoint.pointer import read_pointer
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_demo_trains_verifies_promotes_and_prints_status(prefect_api, tmp_path):
    profile = tmp_path / "demo.yaml"
    profile.write_text(
        "job: {name: demo-test, save_dir: checkpoints, layout: {data_parallel: 2}}\n"
        "verify: {settle_seconds: 5, wait_timeout_seconds: 60, poll_seconds: 1}\n"
        "retention: {keep_verified: 2}\n"
        f"prefect: {{api_url: '{prefect_api}', home: prefect}}\n"
        "local_job: {nproc: 2, train_iters: 12, save_interval: 4, timeout_seconds: 600}\n"
        "archive: {url: archive, keep: 2}\n"
        "drill: {scratch_dir: scratch, budget_seconds: {shared: 600, archive: 600}}\n"
        "health: {nodes: [localhost], transport: local, gpus_per_node: 1, raw_dir: health}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "infra.demo", str(profile)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "COLUMNS": "300"},
    )  # long lines unwrapped, to match whole

    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Prefect server: reused" in result.stdout
    assert "verify-and-promote (training finished): Completed" in result.stdout
    assert read_pointer(tmp_path / "checkpoints") == 12
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("iter_*")) == [
        "iter_0000008",
        "iter_0000012",
    ]
    assert "checkpoints in" in result.stdout and prefect_api.removesuffix("/api") in result.stdout
    assert "archive-copy: Completed: iteration 12: committed" in result.stdout
    assert "restore-drill: PASS drill from shared, iteration 12" in result.stdout
    assert "restore-drill: PASS drill from archive, iteration 12" in result.stdout
    assert (
        "node-health: Failed: 1 nodes: FAIL_CONFIG 1; localhost FAIL_CONFIG: gpu-count: no GPUs found"
        in result.stdout
    )
