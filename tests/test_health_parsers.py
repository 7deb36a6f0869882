"""DCGM and nccl-tests parsers on real outputs (tests/data/health, sources in SOURCES.md) and on
synthetic cases (files named synthetic_*) for every other branch."""

import json
import subprocess
from pathlib import Path

import pytest

from tasks.health.dcgm import classify_diag, gpu_count, nvlink_down
from tasks.health.nccl import Gate, Gates, classify_allreduce, parse_allreduce
from tasks.outcome import Verdict
from tests.conftest import ROOT

DATA = Path(__file__).parent / "data" / "health"
CKPTOPS = ROOT / ".venv" / "bin" / "ckptops"


def gates(pass_gbps: float, warn_gbps: float) -> Gates:
    """The same gate for one node and several: these tests are about the numbers."""
    gate = Gate("the test's gate", pass_gbps, warn_gbps)
    return Gates(gate, gate)


def read(name: str) -> str:
    return (DATA / name).read_text()


# Real outputs.


def test_dcgm4_persistence_mode_is_a_config_failure_not_hardware():
    verdict = classify_diag(read("dcgm4_diag_r1_gb10_fail.json"), 226, level=1)
    assert verdict.verdict is Verdict.FAIL_CONFIG
    first = verdict.evidence[0]
    assert (first.test, first.gpu, first.error_id, first.severity) == ("software", 0, 29, "CONFIG")


def test_dcgm4_pcie_entityless_internal_error_is_a_tool_error():
    verdict = classify_diag(read("dcgm4_diag_r2_text_pcie_internal_error_issue253.txt"), 226, level=2)
    assert verdict.verdict is Verdict.TOOL_ERROR
    assert verdict.detail.startswith("pcie failed with no GPU to blame") and "exclusive" in verdict.detail


@pytest.mark.parametrize(
    "name, level", [("dcgm4_diag_r3_text_pass_docs.txt", 3), ("dcgm3_diag_r4_text_pass_gcm_docstring.txt", 4)]
)
def test_dcgm_text_passes(name, level):
    verdict = classify_diag(read(name), 0, level)
    assert verdict.verdict is Verdict.PASS, [e.detail for e in verdict.evidence]


def test_dcgm4_r3_fragment_wrapped_into_a_document_passes_its_one_test():
    fragment = read("dcgm4_diag_r3_fragment_issue215.jsonfrag").rstrip().rstrip(",")
    document = (
        '{"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [' + fragment + "]}]}}"
    )
    # One test of r3's seven: it passed, but without the level nothing says the set is whole.
    verdict = classify_diag(document, 0)
    assert verdict.verdict is Verdict.WARN and verdict.detail.startswith(
        "1 tests passed on every GPU, but no --level"
    )


def test_discovery_and_nvlink_outputs():
    assert gpu_count(read("dcgm3_discovery_l_8xH800_llm_action.txt")) == 8
    assert gpu_count(read("dcgm3_discovery_list_1xH100_digitalocean.txt")) == 1
    assert nvlink_down(read("dcgm3_nvlink_s_8xH800_llm_action.txt")) == {}


def test_nccl_two_nodes_ib_passes_on_peak_not_average():
    run = parse_allreduce(read("nccl_allreduce_2node_16xH100_ib400_issue309.txt"))
    assert run.average_busbw == 139.56 and len(run.rank_ids) == 16
    verdict = classify_allreduce(read("nccl_allreduce_2node_16xH100_ib400_issue309.txt"), 0, gates(360, 330))
    assert verdict.verdict is Verdict.PASS and verdict.evidence[0].value == 469.21


def test_nccl_gates_are_per_fabric():
    text = read("nccl_allreduce_2node_16xH100_gcp_a3mega.txt")
    assert classify_allreduce(text, 0, gates(330, 300)).verdict is Verdict.PASS  # that fabric's gate
    failed = classify_allreduce(text, 0, gates(360, 350))  # a 400G IB gate
    assert failed.verdict is Verdict.FAIL_HARDWARE and failed.evidence[0].value == 338.82


def test_nccl_old_format_passes():
    verdict = classify_allreduce(read("nccl_allreduce_2node_dgxh100_g8_oldformat.txt"), 0, gates(360, 330))
    assert verdict.verdict is Verdict.PASS and verdict.evidence[0].value == 472.35


@pytest.mark.parametrize(
    "name",
    [
        "nccl_allreduce_2node_init_failure_ncclwarn_issue294_excerpt.txt",
        "nccl_allreduce_unhandled_system_error_issue320.txt",
    ],
)
def test_nccl_failures_to_run_are_tool_errors(name):
    verdict = classify_allreduce(read(name), 3, gates(360, 330))
    assert verdict.verdict is Verdict.TOOL_ERROR and verdict.detail.startswith("the test could not run")


# Synthetic cases (labelled synthetic_ in their names).


@pytest.mark.parametrize(
    "name, exit_code, level, expected, fragment",
    [
        ("synthetic_dcgm3_diag_r1_pass.json", 0, 1, Verdict.PASS, "passed"),
        (
            "synthetic_dcgm3_diag_r2_isolate.json",
            205,
            2,
            Verdict.FAIL_HARDWARE,
            "memory on GPU 1: error 83 (ISOLATE)",
        ),
        ("synthetic_dcgm4_diag_r1_pass.json", 0, 1, Verdict.PASS, "passed on every GPU"),
        (
            "synthetic_dcgm4_diag_r2_isolate.json",
            205,
            2,
            Verdict.FAIL_HARDWARE,
            "memory on GPU 3: error 83 (ISOLATE)",
        ),
        (
            "synthetic_dcgm4_diag_r2_entityless.json",
            226,
            2,
            Verdict.TOOL_ERROR,
            "pcie failed with no GPU to blame",
        ),
        (
            "synthetic_dcgm4_diag_r2_notrun.json",
            0,
            2,
            Verdict.TOOL_ERROR,
            "pcie: no status (listed but did not run)",
        ),
        ("synthetic_dcgm4_diag_r1_monitor.json", 226, 1, Verdict.WARN, "error 100 (MONITOR)"),
        ("synthetic_dcgm4_diag_truncated.json", 0, 2, Verdict.TOOL_ERROR, "not a whole JSON document"),
        (
            "synthetic_dcgm4_diag_r1_pass.json",
            0,
            3,
            Verdict.TOOL_ERROR,
            "expected test diagnostic did not run (level 3)",
        ),
    ],
)
def test_dcgm_branches(name, exit_code, level, expected, fragment):
    verdict = classify_diag(read(name), exit_code, level)
    assert verdict.verdict is expected
    assert any(fragment in e.detail for e in verdict.evidence), [e.detail for e in verdict.evidence]


@pytest.mark.parametrize(
    "exit_code, meaning", [(235, "host engine unreachable"), (245, "timed out"), (1, "not an exit code")]
)
def test_dcgm_empty_output_with_an_error_exit_is_a_tool_error(exit_code, meaning):
    verdict = classify_diag("", exit_code, 1)
    assert verdict.verdict is Verdict.TOOL_ERROR and meaning in verdict.detail


def test_dcgm_nothing_printed_with_exit_0_is_a_tool_error():
    assert classify_diag("   \n", 0, 1).detail == "dcgmi diag printed nothing"


@pytest.mark.parametrize(
    "name, expected, fragment",
    [
        ("synthetic_nccl_cut_after_header.txt", Verdict.TOOL_ERROR, "cut after the header"),
        ("synthetic_nccl_c0_na.txt", Verdict.WARN, "not validated (-c 0)"),
        ("synthetic_nccl_nonmpi.txt", Verdict.FAIL_CONFIG, "nranks 1 and busbw 0.00"),
        ("synthetic_nccl_wrong.txt", Verdict.FAIL_HARDWARE, "wrong results at size 2147483648"),
        ("synthetic_nccl_no_footer.txt", Verdict.TOOL_ERROR, "no footer"),
    ],
)
def test_nccl_branches(name, expected, fragment):
    verdict = classify_allreduce(read(name), 0, gates(431, 410))
    assert verdict.verdict is expected and fragment in verdict.detail


def test_a_finished_table_is_judged_even_when_nccl_warned():
    text = read("nccl_allreduce_2node_16xH100_ib400_issue309.txt")
    warned = text.replace(
        "NCCL version 2.26.2+cuda12.8",
        "node:1:2 [0] NCCL WARN NET/IB : port 1 degraded\nNCCL version 2.26.2+cuda12.8",
    )
    verdict = classify_allreduce(warned, 0, gates(500, 480))  # synthetic: the real run plus one WARN line
    assert verdict.verdict is Verdict.FAIL_HARDWARE and "NCCL WARN NET/IB" in verdict.detail


def test_non_mpi_build_under_mpirun_with_several_processes():
    # Synthetic: the non-MPI file as 8 independent processes would print it, "Rank 0" each time.
    text = read("synthetic_nccl_nonmpi.txt")
    many = text.replace("#  Rank  0", "\n".join(["#  Rank  0"] * 8), 1)
    assert classify_allreduce(many, 0, gates(431, 410)).verdict is Verdict.FAIL_CONFIG


def test_nccl_exit_7_means_wrong_values():
    assert (
        classify_allreduce(read("nccl_allreduce_2node_dgxh100_g8_oldformat.txt"), 7, gates(360, 330)).verdict
        is Verdict.FAIL_HARDWARE
    )


def test_nvlink_down_is_found():
    assert nvlink_down(read("synthetic_nvlink_down.txt")) == {2: [3]}


def test_classify_cli_prints_the_verdict_word_first():
    done = subprocess.run(
        [
            str(CKPTOPS),
            "health",
            "classify",
            "dcgm",
            str(DATA / "dcgm4_diag_r1_gb10_fail.json"),
            "--exit-code",
            "226",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout.startswith("FAIL_CONFIG software on GPU 0: error 29 (CONFIG)")
    passing = subprocess.run(
        [
            str(CKPTOPS),
            "health",
            "classify",
            "nccl",
            str(DATA / "nccl_allreduce_2node_dgxh100_g8_oldformat.txt"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert passing.returncode == 0 and json.loads(passing.stdout)["verdict"] == "PASS"
    missing = subprocess.run(
        [str(CKPTOPS), "health", "classify", "dcgm", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and missing.stderr.startswith("ckptops: /nonexistent:")


def test_dcgm_diag_through_pydcgm_where_the_bindings_import(monkeypatch, tmp_path):
    """On the host that runs the check, with DCGM's bindings importable, the diag goes through
    them (here a stand-in replaying the recorded GB10 run) and is judged like dcgmi's JSON."""
    import sys

    from tasks.cluster.transport import LocalHost
    from tasks.health.checks import Context, dcgm_diag
    from tasks.profile import Health

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "helpers" / "pydcgm_standin"))
    for name in ("pydcgm", "DcgmDiag", "dcgm_structs"):
        sys.modules.pop(name, None)
    settings = Health(nodes=["localhost"], transport="local", raw_dir=tmp_path)
    verdict = dcgm_diag.run(Context("localhost", LocalHost(), settings, 1, tmp_path))
    assert verdict.verdict is Verdict.FAIL_CONFIG
    first = verdict.evidence[0]
    assert (first.test, first.gpu, first.error_id, first.severity) == ("software", 0, 29, "CONFIG")
    import DcgmDiag

    assert DcgmDiag.CALLS == [{"gpuIds": [0], "testNamesStr": "1", "timeout": 300}]
    raw = list((tmp_path / "localhost").iterdir())
    assert len(raw) == 1 and raw[0].read_text().startswith("$ pydcgm diag -r 1")  # the response is kept too


@pytest.mark.parametrize(
    "cell, expected",
    [
        ("inf", "busbw inf at size"),
        ("nan", "busbw nan at size"),
        ("abc", "a data row whose numbers do not parse"),
    ],
)
def test_nccl_busbw_that_is_not_a_number_is_a_tool_error(cell, expected):
    """A real table with one cell garbled (a tool bug, a torn output): never PASS or FAIL on it."""
    lines = read("nccl_allreduce_2node_16xH100_ib400_issue309.txt").splitlines()
    row = next(i for i, line in enumerate(lines) if line.strip().startswith("8589934592"))
    tokens = lines[row].split()
    tokens[7] = cell
    lines[row] = "  ".join(tokens)
    verdict = classify_allreduce("\n".join(lines), 0, gates(360, 330))
    assert verdict.verdict is Verdict.TOOL_ERROR and expected in verdict.detail


def test_nccl_wrong_count_that_is_not_a_number_is_a_tool_error():
    lines = read("nccl_allreduce_2node_16xH100_ib400_issue309.txt").splitlines()
    row = next(i for i, line in enumerate(lines) if line.strip().startswith("8589934592"))
    tokens = lines[row].split()
    tokens[8] = "nan"
    lines[row] = "  ".join(tokens)
    verdict = classify_allreduce("\n".join(lines), 0, gates(360, 330))
    assert verdict.verdict is Verdict.TOOL_ERROR and "do not parse" in verdict.detail


def _pass_document() -> dict:
    return json.loads(read("synthetic_dcgm4_diag_r1_pass.json"))


@pytest.mark.parametrize("status", ["NotRun", "Error", "Running", "", None])
def test_dcgm_results_that_never_ran_are_tool_errors_never_pass(status):
    document = _pass_document()
    entry = document["DCGM Diagnostic"]["test_categories"][0]["tests"][0]["results"][2]
    if status is None:
        del entry["status"]
    else:
        entry["status"] = status
    verdict = classify_diag(json.dumps(document), 0, 1)
    assert verdict.verdict is Verdict.TOOL_ERROR
    quoted = "missing" if status is None else repr(status)
    assert f"software on GPU 2: status {quoted} is not a result" in verdict.detail


def test_dcgm_text_rows_that_are_not_results_are_not_tests_and_no_level_is_no_pass():
    text = read("dcgm4_diag_r3_text_pass_docs.txt") + "\n| stray | text |\n| Memory | NotRun |\n"
    verdict = classify_diag(text, 0, 3)
    assert verdict.verdict is Verdict.TOOL_ERROR and "memory: status 'NotRun'" in verdict.detail
    unsure = classify_diag(read("dcgm4_diag_r3_text_pass_docs.txt"), 0, None)
    assert unsure.verdict is Verdict.WARN and "no --level" in unsure.detail


@pytest.mark.parametrize(
    "mangle, where",
    [
        (lambda d: d["DCGM Diagnostic"].update(test_categories=[1]), "test_categories[0]"),
        (
            lambda d: d["DCGM Diagnostic"]["test_categories"][0]["tests"][0].update(results={"a": 1}),
            "test_categories[0].tests[0].results",
        ),
        (
            lambda d: d["DCGM Diagnostic"]["test_categories"][0]["tests"][0]["results"][0].update(
                entity_id=[0]
            ),
            "test_categories[0].tests[0].results[0].entity_id",
        ),
        (
            lambda d: d["DCGM Diagnostic"]["test_categories"][0]["tests"][0].update(name={"deep": [[[{}]]]}),
            "test_categories[0].tests[0].name",
        ),
    ],
)
def test_dcgm_json_of_unexpected_shapes_is_one_line_naming_the_field(mangle, where, tmp_path):
    document = _pass_document()
    mangle(document)
    verdict = classify_diag(json.dumps(document), 0, 1)
    assert verdict.verdict is Verdict.TOOL_ERROR and where in verdict.detail
    path = tmp_path / "diag.json"
    path.write_text(json.dumps(document))
    done = subprocess.run(
        [str(CKPTOPS), "health", "classify", "dcgm", str(path), "--level", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.startswith(f"ckptops: {path}: ") and where in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


# gpu-processes: nvidia-smi --query-compute-apps against the running job steps (scontrol listpids).


def _gpu_processes_ctx(tmp_path, answers: dict[str, tuple[str, str, int]], node_name: bool = False):
    """A check context whose node answers each tool (nvidia-smi, scontrol) with a recording."""
    from types import SimpleNamespace

    from tasks.cluster.process import Output
    from tasks.health.checks import Context

    class Replay:
        def run(self, argv, timeout):
            stdout, stderr, rc = answers[argv[0]]
            return Output(argv, rc, stdout, stderr, 0.01)

    settings = SimpleNamespace(
        command_timeout_seconds=5, gpu_processes=SimpleNamespace(listpids_node_name=node_name)
    )
    return Context("gpu7", Replay(), settings, 1, tmp_path)


def test_gpu_processes_parse_the_recorded_h200_output_and_slurm_listpids():
    from tasks.health.checks.gpu_processes import compute_apps, listpids

    apps = compute_apps(read("nvidia_smi_compute_apps_8xH200_before.csv"))
    assert len(apps) == 8 and apps[0].gpu == "GPU-a44622e3-2296-6285-0a86-84d0f6c67900"
    assert (apps[0].pid, apps[0].name, apps[0].memory) == (1328667, "/usr/local/bin/python3.10", "130004 MiB")
    assert (apps[-1].pid, apps[-1].name) == (1758887, "[Not Found]")  # another pid namespace
    assert compute_apps(read("nvidia_smi_compute_apps_header_only.csv")) == []
    # A process name holding commas (a command line) stays one name.
    comma = "gpu_uuid, pid, process_name, used_gpu_memory [MiB]\nGPU-1, 42, python -c a,b, 10 MiB\n"
    assert compute_apps(comma)[0].name == "python -c a,b"
    assert listpids(read("slurm22_scontrol_listpids_job440.txt")) == {
        26790: "440",
        26803: "440",
        26800: "440",
        26825: "440",
    }
    with pytest.raises(ValueError, match="not a --query-compute-apps output"):
        compute_apps(read("synthetic_row_remap_ok.csv"))


def test_gpu_processes_fail_a_node_whose_gpus_hold_processes_of_no_running_job(tmp_path):
    from tasks.health.checks import gpu_processes

    before = read("nvidia_smi_compute_apps_8xH200_before.csv")
    job = read("synthetic_scontrol_listpids_h200_job.txt")
    check = gpu_processes.run(
        _gpu_processes_ctx(tmp_path, {"nvidia-smi": (before, "", 0), "scontrol": (job, "", 0)})
    )
    assert check.verdict is Verdict.FAIL_CONFIG
    orphans = [e.value for e in check.evidence]
    assert orphans == [1425258, 1425259, 1425260, 1425261, 1758887]  # job 7001's 3 pids are not named
    assert check.detail.startswith(
        "GPU GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90: pid 1425258 (python3, 105842 MiB) belongs to no "
        "running Slurm job (and 4 more)"
    )
    assert "pid 1758887 ([Not Found], 58060 MiB)" in check.evidence[-1].detail

    # Every process in a running job: a pass that names the job.
    owned = job + "".join(f"{pid} 7002 0 0 0\n" for pid in (1425258, 1425259, 1425260, 1425261, 1758887))
    check = gpu_processes.run(
        _gpu_processes_ctx(tmp_path, {"nvidia-smi": (before, "", 0), "scontrol": (owned, "", 0)})
    )
    assert check.verdict is Verdict.PASS and "all in running Slurm jobs (7001, 7002)" in check.detail

    # A node without job steps (the real Slurm answer: exit 1): every GPU process is left over.
    no_steps = (
        read("slurm22_scontrol_listpids_no_steps.stdout"),
        read("slurm22_scontrol_listpids_no_steps.stderr"),
        1,
    )
    after = read("nvidia_smi_compute_apps_8xH200_after.csv")
    check = gpu_processes.run(
        _gpu_processes_ctx(tmp_path, {"nvidia-smi": (after, "", 0), "scontrol": no_steps})
    )
    assert check.verdict is Verdict.FAIL_CONFIG and len(check.evidence) == 4

    # No GPU process: no need to ask Slurm at all (scontrol would fail here).
    empty = read("nvidia_smi_compute_apps_header_only.csv")
    check = gpu_processes.run(
        _gpu_processes_ctx(tmp_path, {"nvidia-smi": (empty, "", 0), "scontrol": ("", "", 127)})
    )
    assert check.verdict is Verdict.PASS and check.detail == "no compute processes on the GPUs"


def test_gpu_processes_never_pass_when_a_tool_cannot_answer(tmp_path):
    from tasks.health.checks import gpu_processes

    before = read("nvidia_smi_compute_apps_8xH200_before.csv")
    refused = (
        "",
        "scontrol: error: Domain socket directory /var/spool/slurmd: No such file or directory\n"
        "No job steps exist on this node.\n",
        1,
    )
    cases = {
        "no scontrol": ({"nvidia-smi": (before, "", 0), "scontrol": ("", "", 127)}, "command not found"),
        "slurmd unreachable": ({"nvidia-smi": (before, "", 0), "scontrol": refused}, "Domain socket"),
        "no nvidia-smi": ({"nvidia-smi": ("", "", 127), "scontrol": ("", "", 0)}, "command not found"),
        "nvidia-smi failed": ({"nvidia-smi": ("", "NVML error\n", 9), "scontrol": ("", "", 0)}, "exited 9"),
        "another output": (
            {"nvidia-smi": (read("synthetic_recovery_none.csv"), "", 0), "scontrol": ("", "", 0)},
            "not a --query-compute-apps output",
        ),
    }
    for case, (answers, says) in cases.items():
        check = gpu_processes.run(_gpu_processes_ctx(tmp_path, answers))
        assert check.verdict is Verdict.TOOL_ERROR and says in check.detail, (case, check.detail)


def test_gpu_processes_names_the_node_to_listpids_only_when_told(tmp_path):
    from tasks.health.checks.gpu_processes import listpids_argv

    assert listpids_argv(_gpu_processes_ctx(tmp_path, {})) == ["scontrol", "listpids"]
    assert listpids_argv(_gpu_processes_ctx(tmp_path, {}, node_name=True)) == [
        "scontrol",
        "listpids",
        "*",
        "gpu7",
    ]


# conformance: versions, clocks, power limit, NIC firmware and rate (tasks/health/checks/conformance.py).

CONFORMANCE_ANSWERS = {
    "gpu-facts": "nvidia_smi_query_gpu_8xH100_driver_power_clocks.csv",
    "banner": "nvidia_smi_banner_8xH100_565.txt",
    "uname": "uname_r_el9_h100.txt",
    "ibstat": "ibstat_8xMT4129_ndr400_bond_gpud_all_active.txt",
    "python3": "torch_nccl_version_2_29_7.txt",
}


def _conformance_ctx(tmp_path, replace: dict | None = None, **section):
    """A check context whose node answers each conformance command with a recording (by the
    fake nodes' own keys, tests/helpers/standin.py); a key answered None has no such tool."""
    from types import SimpleNamespace

    from tasks.cluster.process import Output
    from tasks.health.checks import Context
    from tasks.profile import Conformance
    from tests.helpers.standin import key

    answers = {k: (read(v), "", 0) for k, v in CONFORMANCE_ANSWERS.items()} | (replace or {})

    class Replay:
        def run(self, argv, timeout):
            stdout, stderr, rc = answers.get(key(argv[0], argv[1:])) or ("", "", 127)
            return Output(argv, rc, stdout, stderr, 0.01)

    settings = SimpleNamespace(command_timeout_seconds=5, conformance=Conformance(**section))
    return Context("gpu7", Replay(), settings, 1, tmp_path)


def test_conformance_parse_the_recorded_outputs():
    from tasks.health.checks.conformance import (
        adapters,
        cuda_version,
        gpu_facts,
        gpu_rows,
        kernel_release,
        nccl_version,
        nic_facts,
    )

    rows = gpu_rows(read("nvidia_smi_query_gpu_8xH100_driver_power_clocks.csv"))
    assert [r["index"] for r in rows] == [str(i) for i in range(8)]
    # The recorded query has no clocks.applications.memory column: that fact is not read.
    assert gpu_facts(rows) == ({"driver": "580.126.20", "gpu_clock_mhz": "1980", "power_limit_w": "700"}, [])
    # A GPU that cannot say (nvidia-smi's bracketed answers) leaves its value out, not the fact.
    unsupported = "index, driver_version, clocks.applications.memory [MHz]\n0, 550.54.15, [Not Supported]\n"
    assert gpu_facts(gpu_rows(unsupported)) == ({"driver": "550.54.15"}, [])
    assert cuda_version(read("nvidia_smi_banner_8xH100_565.txt")) == "12.7"
    assert kernel_release(read("uname_r_el9_h100.txt")) == "5.14.0-427.124.1.el9_4.x86_64"
    assert nccl_version(read("torch_nccl_version_2_29_7.txt")) == "2.29.7"
    assert nccl_version("21805\n") == "2.18.5" and nccl_version("2708") == "2.7.8"  # NCCL's version codes
    found = adapters(read("ibstat_8xMT4129_ndr400_bond_gpud_all_active.txt"))
    assert [a.name for a in found][-1] == "mlx5_bond_0" and len(found) == 9
    assert nic_facts(found) == (
        {"nic_firmware": "MT4129 28.41.1000, MT41692 32.38.3056", "nic_rate_gbps": "400 x8, 200 x1"},
        [],
    )
    # Three storage ports down: only the active ports' rates count.
    down = nic_facts(adapters(read("ibstat_8xMT4129_ndr400_4xMT4125_gpud_some_down.txt")))[0]
    assert down == {"nic_firmware": "MT4125 22.38.1002, MT4129 28.39.1002", "nic_rate_gbps": "400 x8, 100 x1"}
    # Another tool's output is never read as this one's.
    with pytest.raises(ValueError, match="not a --query-gpu output"):
        gpu_rows(read("nvidia_smi_compute_apps_8xH200_before.csv"))
    with pytest.raises(ValueError, match="no channel adapter"):
        adapters(read("nvidia_smi_banner_8xH100_565.txt"))
    with pytest.raises(ValueError, match="no CUDA Version"):
        cuda_version(read("nvidia_smi_query_gpu_8xH100_driver_power_clocks.csv"))
    with pytest.raises(ValueError, match="not a kernel release"):
        kernel_release(read("nvidia_smi_banner_8xH100_565.txt"))
    with pytest.raises(ValueError, match="not an NCCL version"):
        nccl_version("ModuleNotFoundError: No module named 'torch'\n")


def test_conformance_passes_a_node_that_matches_its_pins_and_fails_one_that_does_not(tmp_path):
    from tasks.health.checks import conformance

    ctx = _conformance_ctx(tmp_path)
    check = conformance.run(ctx)
    assert check.verdict is Verdict.PASS, check.detail
    assert check.detail.startswith("driver 580.126.20, cuda 12.7, kernel 5.14.0-427.124.1.el9_4.x86_64")
    assert "memory_clock_mhz not read (nvidia-smi gave no value)" in check.detail
    assert "nccl not read (no health.conformance.nccl_command)" in check.detail
    assert ctx.facts["nic_rate_gbps"] == "400 x8, 200 x1" and "nccl" not in ctx.facts

    # Pins: numbers as numbers (700 is 700.00 W), anything else exactly.
    pins = {"driver": "580.126.20", "power_limit_w": 700, "nic_rate_gbps": "400 x8, 200 x1", "nccl": "2.29.7"}
    ctx = _conformance_ctx(tmp_path, pins=pins, nccl_command=["python3", "-c", "..."])
    check = conformance.run(ctx)
    assert check.verdict is Verdict.PASS and ctx.facts["nccl"] == "2.29.7", check.detail

    check = conformance.run(_conformance_ctx(tmp_path, pins={"power_limit_w": 650, "cuda": "12.4"}))
    assert check.verdict is Verdict.FAIL_CONFIG
    assert [e.detail for e in check.evidence] == [
        "cuda 12.7, expected 12.4 (pinned)",
        "power_limit_w 700, expected 650 (pinned)",
    ]

    # One GPU at lower application clocks and power limit than the node's others (synthetic).
    slow = {"gpu-facts": (read("synthetic_nvidia_smi_query_gpu_8xH100_gpu5_slow.csv"), "", 0)}
    check = conformance.run(_conformance_ctx(tmp_path, slow))
    assert check.verdict is Verdict.FAIL_CONFIG
    assert (
        check.detail
        == "gpu_clock_mhz differs between the node's GPUs: 1980 on GPUs 0,1,2,3,4,6,7; 1755 on GPU 5"
    )
    assert "power_limit_w differs between the node's GPUs: 700 on GPUs 0,1,2,3,4,6,7; 500 on GPU 5" in [
        e.detail for e in check.evidence
    ]


def test_conformance_reads_around_an_absent_tool_unless_its_fact_is_pinned(tmp_path):
    from tasks.health.checks import conformance

    no_ibstat = {"ibstat": None}
    ctx = _conformance_ctx(tmp_path, no_ibstat)
    check = conformance.run(ctx)
    assert check.verdict is Verdict.PASS
    assert "nic_firmware, nic_rate_gbps not read (ibstat is not on the node)" in check.detail
    assert "nic_firmware" not in ctx.facts and ctx.facts["driver"] == "580.126.20"

    check = conformance.run(_conformance_ctx(tmp_path, no_ibstat, pins={"nic_firmware": "MT4129 28.41.1000"}))
    assert check.verdict is Verdict.TOOL_ERROR
    assert (
        check.detail == "nic_firmware is pinned (MT4129 28.41.1000) but not read: ibstat is not on the node"
    )

    # Garbled or failed outputs are tool errors, never a pass, and say which command.
    cases = {
        "ibstat said something else": (
            {"ibstat": (read("synthetic_row_remap_ok.csv"), "", 0)},
            "ibstat: no channel",
        ),
        "nvidia-smi failed": ({"gpu-facts": ("", "NVML error\n", 9)}, "nvidia-smi exited 9"),
        "uname said two words": ({"uname": ("Linux 6.8\n", "", 0)}, "uname -r: not a kernel release"),
        "nccl command broke": (
            {"python3": ("Traceback\nImportError: torch\n", "", 0)},
            "not an NCCL version",
        ),
    }
    for case, (answers, says) in cases.items():
        check = conformance.run(_conformance_ctx(tmp_path, answers, nccl_command=["python3", "-c", "..."]))
        assert check.verdict is Verdict.TOOL_ERROR and says in check.detail, (case, check.detail)
