"""The house rules `make lint` checks beside ruff (infra/lint): no import cycle between the
packages of tasks/, no function over 80 lines; each checker run on a planted breach (make lint
runs them on this repository)."""

import importlib.util
import textwrap
from pathlib import Path

from tests.conftest import ROOT


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "infra" / "lint" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cycles = _load("import_cycles")
lengths = _load("long_functions")


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_cycle_between_packages_is_found_through_late_and_relative_imports(tmp_path):
    _write(
        tmp_path,
        {
            "tasks/__init__.py": "",
            "tasks/alpha/__init__.py": "",
            "tasks/alpha/one.py": "def f():\n    from tasks.beta import two\n",
            "tasks/beta/__init__.py": "",
            "tasks/beta/two.py": "from ..gamma import three\n",
            "tasks/gamma/__init__.py": "",
            "tasks/gamma/three.py": "import tasks.alpha.one\n",
            "tasks/delta.py": "from tasks import alpha\n",
        },
    )
    edges = cycles.graph(tmp_path)
    assert edges["alpha"] == {"beta"} and edges["beta"] == {"gamma"} and edges["delta"] == {"alpha"}
    assert cycles.cycles(edges) == [["alpha", "beta", "gamma"]]
    (tmp_path / "tasks/gamma/three.py").write_text("import os\n")  # the edge back removed
    assert cycles.cycles(cycles.graph(tmp_path)) == []


def test_a_function_over_eighty_lines_is_named_with_its_length(tmp_path):
    body = [f"x{i} = {i}\n" for i in range(79)]
    method = "".join("        " + line for line in [*body, "y = 1\n", "z = 2\n"])
    _write(
        tmp_path,
        {
            # 80 lines with its def: allowed; a method of 82: named; a test of any length: not judged.
            "tasks/long.py": "def fits():\n"
            + "".join("    " + line for line in body)
            + "\n\nclass A:\n    def over(self):\n"
            + method,
            "tests/test_long.py": "def test_long():\n" + "".join("    " + line for line in body * 2),
        },
    )
    assert lengths.long_functions(tmp_path) == [("tasks/long.py", 84, "over", 82)]


def test_a_flow_run_starts_without_importing_torch():
    """Every flow run is a new process on the worker (a verify-and-promote poll every 30 s among
    them): importing the flows and the CLI must not import torch (about 3 s of CPU) before a
    checkpoint is actually read."""
    import subprocess
    import sys

    flows = sorted(p.stem for p in (ROOT / "flows").glob("*.py") if p.stem != "__init__")
    code = "; ".join(f"import flows.{name}" for name in flows)
    code += (
        "; import tasks.cli; import sys; print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"imported at start: {done.stdout.strip()}"
