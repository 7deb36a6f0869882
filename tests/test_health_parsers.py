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
