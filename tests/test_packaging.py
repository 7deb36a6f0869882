"""ckptops as users install it: a wheel in a fresh virtual environment outside the checkout, and
the step recorder inside a training job whose Megatron-LM has a ``tasks`` package of its own."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT, iter_dir


def run(argv, **kwargs):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600, **kwargs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv outside the checkout with ckptops' wheel installed; its dependencies (torch and
    the rest, gigabytes) are this venv's, added to its path without their .pth files (so this
    checkout's editable install stays out)."""
    root = tmp_path_factory.mktemp("installed")
    # Built with this venv's setuptools: no build environment to make and fill from the index.
    built = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            root / "dist",
            ROOT,
        ]
    )
    assert built.returncode == 0, built.stderr
    wheel = next((root / "dist").glob("ckptops-*.whl"))
    # Without a pip of its own (ensurepip costs 4 CPU-s): this venv's pip installs into it.
    venv = root / "venv"
    assert run([sys.executable, "-m", "venv", "--without-pip", venv]).returncode == 0
    site = next((venv / "lib").glob("python3.*/site-packages"))
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = ["--python", venv / "bin" / "python"]
    done = run([sys.executable, "-m", "pip", *python, "install", "--no-deps", "--quiet", wheel])
    assert done.returncode == 0, done.stderr
    return venv


def test_the_installed_wheel_verifies_and_classifies_outside_the_checkout(installed, save_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = run(
        [
            installed / "bin" / "python",
            "-c",
            "import tasks, profiles; print(tasks.__file__, profiles.__file__)",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert where.stdout.split() and all(str(installed) in p for p in where.stdout.split()), where
    verify = run(
        [installed / "bin" / "ckptops", "verify", iter_dir(save_dir, 4), "--read-only"], cwd=tmp_path, env=env
    )
    assert verify.returncode == 0 and verify.stdout.startswith("VALID iter_0000004"), verify.stderr
    sample = ROOT / "tests" / "data" / "health" / "nccl_allreduce_2node_16xH100_ib400_issue309.txt"
    classify = run(
        [installed / "bin" / "ckptops", "health", "classify", "nccl", sample], cwd=tmp_path, env=env
    )
    assert classify.returncode == 0 and classify.stdout.startswith("PASS peak out-of-place busbw 469.21"), (
        classify
    )
    template = run(
        [
            installed / "bin" / "python",
            "-c",
            "from tasks.restore.launch import SBATCH_TEMPLATE; print(SBATCH_TEMPLATE.read_text()[:11])",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert template.stdout.strip() == "#!/bin/bash", template.stderr


MEGATRON_TASKS = {"__init__.py": "", "main.py": "SOURCE = 'megatron-lm'\n", "finetune_utils.py": ""}


@pytest.mark.parametrize("megatron_first", [True, False])
def test_the_step_recorder_imports_beside_megatron_lms_tasks_package(tmp_path, megatron_first):
    megatron = tmp_path / "megatron-lm"
    (megatron / "tasks").mkdir(parents=True)
    for name, text in MEGATRON_TASKS.items():
        (megatron / "tasks" / name).write_text(text)
    path = [str(megatron), str(ROOT)] if megatron_first else [str(ROOT), str(megatron)]
    script = (
        "import sys; sys.path[:0] = {!r}\n"
        "from ckptops_records import StepRecorder, batch_summary\n"
        "r = StepRecorder({!r}, 'run', 'a'); r.record(iteration=1, consumed_samples=8, lr=1e-3,\n"
        "    batch=batch_summary(0, range(8)), loss=2.5, grad_norm=1.0, skipped=0, nan=0, tokens=256,\n"
        "    step_seconds=0.1); r.close()\n"
        "import tasks; print(tasks.__file__)\n".format(path, str(tmp_path / "steps.jsonl"))
    )
    done = run([sys.executable, "-c", script], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "steps.jsonl").read_text().count('"iteration": 1') == 1
    first = megatron if megatron_first else ROOT
    assert done.stdout.strip().startswith(str(first / "tasks"))  # whichever comes first, the recorder works
