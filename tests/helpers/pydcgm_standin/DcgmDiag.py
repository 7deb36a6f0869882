"""Stand-in for DCGM 4.x DcgmDiag: replays a recorded diag as the bindings' response struct.

RECORDED is the real `dcgmi diag -r 1 -j` output of tests/data/health/dcgm4_diag_r1_gb10_fail.json
(DCGM 4.2.3, GB10: software fails on GPU 0, error 29, severity 5, persistence mode), converted
into the shape of DCGM 4.x's dcgmDiagResponse: tests, results and errors, linked by testId.
"""

import json
from pathlib import Path
from types import SimpleNamespace

_DOC = json.loads(
    (Path(__file__).resolve().parents[2] / "data" / "health" / "dcgm4_diag_r1_gb10_fail.json").read_text()
)
_RESULT = {"Pass": 0, "Skip": 1, "Warn": 2, "Fail": 3}


def _replay(doc):
    tests, results, errors = [], [], []
    for category in doc["DCGM Diagnostic"]["test_categories"]:
        for test in category["tests"]:
            test_id = len(tests)
            tests.append(
                SimpleNamespace(name=test["name"].encode(), result=_RESULT[test["test_summary"]["status"]])
            )
            for entry in test["results"]:
                entity = SimpleNamespace(entityGroupId=entry["entity_group_id"], entityId=entry["entity_id"])
                results.append(
                    SimpleNamespace(entity=entity, result=_RESULT[entry["status"]], testId=test_id)
                )
                for warning in entry.get("warnings", []):
                    errors.append(
                        SimpleNamespace(
                            entity=entity,
                            code=warning["error_id"],
                            category=warning["error_category"],
                            severity=warning["error_severity"],
                            msg=warning["warning"],
                            testId=test_id,
                        )
                    )
    return SimpleNamespace(
        numTests=len(tests),
        tests=tests,
        numResults=len(results),
        results=results,
        numErrors=len(errors),
        errors=errors,
    )


RECORDED = _replay(_DOC)
CALLS = []


class DcgmDiag:
    def __init__(self, gpuIds=None, testNamesStr="1", timeout=0):
        CALLS.append({"gpuIds": gpuIds, "testNamesStr": testNamesStr, "timeout": timeout})

    def Execute(self, handle):
        return RECORDED
