"""The suite's warm start (tests/helpers/warm) gives a process what a cold start gives it: its
command line, environment, working directory, streams, exit status, death by a signal, signals
sent to it, and an end when whatever stands for it is killed."""

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.helpers.poll import until

# An entry the warm servers take by its name (the other test loop's), here a probe of what the
# process it runs in was given.
PROBE = """
import json, os, signal, sys, time
mode = sys.argv[1]
if mode == "wait":  # the handler is in place before the pid is printed
    def stop(sig, frame):
        print("got", signal.Signals(sig).name, flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, stop)
print(json.dumps({
    "pid": os.getpid(),
    "warm": "megatron.core" in sys.modules,
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "env": os.environ.get("PROBE_VALUE"),
    "main": __name__,
}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if mode == "exit":
    sys.exit(7)
if mode == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
if mode == "wait":
    time.sleep(600)
"""

pytestmark = pytest.mark.skipif("CKPTOPS_WARM_DIR" not in os.environ, reason="the warm servers are off")


@pytest.fixture
def probe(tmp_path):
    script = tmp_path / "core_loop.py"
    script.write_text(PROBE)
    return script


def start(probe, mode: str, tmp_path, warm: bool = True) -> subprocess.Popen:
    env = {**os.environ, "PROBE_VALUE": "given"}
    if not warm:
        env.pop("CKPTOPS_WARM_DIR")
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, str(probe), mode, "--flag"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_warm_process_gets_its_command_line_environment_cwd_streams_and_exit_status(probe, tmp_path):
    run = start(probe, "exit", tmp_path)
    out, err = run.communicate(timeout=120)
    seen = json.loads(out)
    assert run.returncode == 7 and err == "to stderr\n"
    assert seen["warm"] and seen["pid"] != run.pid
    assert seen["argv"] == [str(probe), "exit", "--flag"] and seen["main"] == "__main__"
    assert seen["cwd"] == str(tmp_path / "cwd") and seen["env"] == "given"
    cold = start(probe, "exit", tmp_path, warm=False)
    out, _ = cold.communicate(timeout=120)
    assert cold.returncode == 7 and not json.loads(out)["warm"] and json.loads(out)["pid"] == cold.pid


def test_a_warm_process_killed_by_a_signal_ends_its_stand_in_by_that_signal(probe, tmp_path):
    run = start(probe, "signal", tmp_path)
    run.communicate(timeout=120)
    assert run.returncode == -signal.SIGTERM


def test_signals_reach_the_warm_process_and_killing_its_stand_in_ends_it(probe, tmp_path):
    run = start(probe, "wait", tmp_path)
    worker = json.loads(run.stdout.readline())["pid"]
    run.send_signal(signal.SIGTERM)
    out, _ = run.communicate(timeout=60)
    assert (run.returncode, out) == (3, "got SIGTERM\n")  # its own handler ran: the signal reached it

    run = start(probe, "wait", tmp_path)
    worker = json.loads(run.stdout.readline())["pid"]
    run.kill()
    run.wait(timeout=60)
    until(lambda: not psutil.pid_exists(worker), 30, "the warm process to end with its stand-in")


def test_a_warm_process_has_the_prefect_settings_of_its_own_environment(tmp_path):
    """The ckptops flavor imported Prefect before it forked, with the server's environment:
    a forked process (a flow run, the CLI, a Prefect server) must read its own, as a cold one does."""
    script = tmp_path / "ckptops"  # an entry the ckptops flavor takes by its name
    script.write_text(
        "import json, os, sys\n"
        "from prefect.settings import get_current_settings\n"
        "settings = get_current_settings()\n"
        'print(json.dumps({"pid": os.getpid(), "warm": "torch" in sys.modules,\n'
        '                  "api": settings.api.url, "home": str(settings.home)}))\n'
    )
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api", "PREFECT_HOME": str(tmp_path / "home")}
    run = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    out, _ = run.communicate(timeout=120)
    seen = json.loads(out)
    assert run.returncode == 0 and seen["warm"] and seen["pid"] != run.pid
    assert seen["api"] == "http://127.0.0.1:9/api" and seen["home"] == str(tmp_path / "home")


def test_an_xdist_worker_starts_as_python_c_would_with_its_code_read_from_stdin(tmp_path):
    """pytest-xdist's workers start warm: execnet's ``python -u -c BOOTSTRAP`` reads its code
    from stdin, runs it in a new ``__main__`` with the working directory first on sys.path and
    unbuffered output, as a cold interpreter does."""
    from execnet.gateway_io import popen_bootstrapline

    code = (
        "import json, os, sys\n"
        'print(json.dumps({"pid": os.getpid(), "warm": "torch" in sys.modules, "argv": sys.argv,\n'
        '    "main": __name__, "first": sys.path[0], "cwd": os.getcwd(), "fresh": "serve" not in globals(),\n'
        '    "unbuffered": sys.stdout.write_through, "line": sys.stdin.readline()}))\n'
    )

    def run(warm: bool) -> tuple[subprocess.Popen, dict]:
        env = dict(os.environ) if warm else {k: v for k, v in os.environ.items() if k != "CKPTOPS_WARM_DIR"}
        started = subprocess.Popen(
            [sys.executable, "-u", "-c", popen_bootstrapline],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        out, _ = started.communicate(repr(code) + "\nthe next line\n", timeout=120)
        return started, json.loads(out)

    warm, seen = run(True)
    cold, expected = run(False)
    assert warm.returncode == cold.returncode == 0
    assert seen["warm"] and seen["pid"] != warm.pid and not expected["warm"]
    for key in ("argv", "main", "first", "cwd", "fresh", "unbuffered", "line"):
        assert seen[key] == expected[key], key
    assert seen["line"] == "the next line\n" and seen["unbuffered"] and seen["first"] == ""
