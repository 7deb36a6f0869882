"""DCGM diagnostics at the chosen level.

Through pydcgm where DCGM's Python bindings import on the host that runs the check (they ship
with DCGM, not on PyPI), otherwise ``dcgmi diag -r N -j`` on the node. Both end in the same
judgement (tasks.health.dcgm): the bindings' response is turned into the 4.x JSON shape first.
"""

import importlib
import json
import sys
import time
from pathlib import Path

from tasks.cluster.transport import LocalHost
from tasks.health.checks import Context, not_run
from tasks.health.dcgm import CHECK, classify_diag, judge_document
from tasks.health.verdict import Evidence, HealthCheck, result
from tasks.outcome import Verdict

NAME = CHECK
BINDINGS = [
    Path("/usr/share/datacenter-gpu-manager-4/bindings/python3"),
    Path("/usr/local/dcgm/bindings/python3"),
]
# DCGM 4.x dcgmDiagResult_t: what each entity and test result means.
_RESULT = {0: "Pass", 1: "Skip", 2: "Warn", 3: "Fail", 4: "NotRun"}


def _bindings():
    """pydcgm and friends if they import here, else None."""
    for path in BINDINGS:
        if path.is_dir() and str(path) not in sys.path:
            sys.path.append(str(path))
    try:
        return (
            importlib.import_module("pydcgm"),
            importlib.import_module("DcgmDiag"),
            importlib.import_module("dcgm_structs"),
        )
    except ImportError:
        return None


def _response_document(response) -> dict:
    """A DCGM 4.x diag response struct as the JSON document ``dcgmi diag -j`` would print."""
    tests = []
    for t in range(response.numTests):
        test = response.tests[t]
        results = []
        for r in range(response.numResults):
            entry = response.results[r]
            if entry.testId != t:
                continue
            problems = [
                {
                    "error_id": e.code,
                    "error_severity": e.severity,
                    "error_category": e.category,
                    "warning": e.msg,
                }
                for e in (response.errors[i] for i in range(response.numErrors))
                if e.testId == t
                and e.entity.entityId == entry.entity.entityId
                and e.entity.entityGroupId == 1
            ]
            results.append(
                {
                    "entity_group": "GPU",
                    "entity_id": entry.entity.entityId,
                    "status": _RESULT.get(entry.result, "Fail"),
                    "warnings": problems,
                }
            )
        entityless = [
            {"error_id": e.code, "error_severity": e.severity, "warning": e.msg}
            for e in (response.errors[i] for i in range(response.numErrors))
            if e.testId == t and e.entity.entityGroupId != 1
        ]
        name = test.name.decode() if isinstance(test.name, bytes) else str(test.name)
        tests.append(
            {
                "name": name,
                "results": results,
                "test_summary": {"status": _RESULT.get(test.result, "Fail"), "warnings": entityless},
            }
        )
    return {"DCGM Diagnostic": {"test_categories": [{"category": "all", "tests": tests}]}}


def _with_bindings(modules, ctx: Context, timeout: float) -> HealthCheck:
    pydcgm, dcgm_diag, dcgm_structs = modules
    try:
        handle = pydcgm.DcgmHandle(opMode=dcgm_structs.DCGM_OPERATION_MODE_AUTO)
        gpus = handle.GetSystem().discovery.GetAllSupportedGpuIds()
        response = dcgm_diag.DcgmDiag(gpuIds=gpus, testNamesStr=str(ctx.level), timeout=int(timeout)).Execute(
            handle.handle
        )
    except Exception as e:  # the bindings raise their own DCGMError family, and ctypes errors
        return result(NAME, Verdict.TOOL_ERROR, Evidence(f"pydcgm diag failed ({type(e).__name__}: {e})"))
    document = _response_document(response)
    ctx.kept.append(ctx.keep(NAME, f"pydcgm diag -r {ctx.level}", json.dumps(document, indent=1)))
    return judge_document(document, ctx.level)


def run(ctx: Context) -> HealthCheck:
    timeout = ctx.settings.diag_timeout_seconds[ctx.level]
    modules = _bindings() if isinstance(ctx.host, LocalHost) else None
    if modules is not None:
        started = time.monotonic()
        judged = _with_bindings(modules, ctx, timeout)
        judged.seconds = time.monotonic() - started
        return judged
    output = ctx.command(NAME, ["dcgmi", "diag", "-r", str(ctx.level), "-j"], timeout)
    failed = not_run(NAME, output)
    if failed:
        return failed
    return classify_diag(output.stdout, output.exit_code, ctx.level)
