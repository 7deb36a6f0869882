"""DCGM outputs (``dcgmi diag``, ``discovery``, ``nvlink``) into verdicts.

Rules, from DCGM 3.3.9 and 4.6.0 and the operators who run them (Azure HPC health checks, Meta GCM):
- DCGM's own status is only Pass/Fail/Skip, and a warning shows as Fail: decide on each error's
  ``error_id`` and ``error_severity`` (MONITOR 1 -> WARN, CONFIG 5 -> FAIL_CONFIG, ISOLATE 2,
  UNKNOWN 3, TRIAGE 4, RESET 6 -> FAIL_HARDWARE).
- A test that appears by name only did not run, and Skip is never a pass: TOOL_ERROR. Every test
  the level should run must be there (tests go missing after upgrades).
- In 4.x an error not tied to a GPU shows only in the test's summary: a test can Fail while
  every GPU says Pass. An entity-less *internal* error (pcie inside a shared job) is a tool error:
  rerun on an exclusive node, do not drain.
- Exit codes 0, 226 (found errors) and 205 (found an ISOLATE error) come with a whole document;
  anything else is a tool error whatever was printed.
- JSON dialects: 3.x root ``DCGM GPU Diagnostic``, tests by display name, ``gpu_id`` string or
  int; 4.x root ``DCGM Diagnostic``, tests by plugin name, ``entity_id``, ``test_summary``.
"""

import json
import re

from tasks.health.verdict import CheckName, Evidence, HealthCheck, result
from tasks.outcome import Verdict, worst

SEVERITY = {1: "MONITOR", 2: "ISOLATE", 3: "UNKNOWN", 4: "TRIAGE", 5: "CONFIG", 6: "RESET"}
SEVERITY_VERDICT = {1: Verdict.WARN, 5: Verdict.FAIL_CONFIG}  # every other severity: hardware
RAN = {0: "ran clean", 226: "ran and found errors", 205: "found an ISOLATE-class error"}
TOOL_EXIT = {
    203: "killed",
    217: "another diagnostic is running",
    245: "timed out",
    235: "host engine unreachable",
    242: "no data",
    254: "exception",
    127: "dcgmi not installed",
}

# The tests each run level must include, by 4.x plugin name (3.x display names are mapped).
LEVEL_TESTS = {
    1: {"software"},
    2: {"software", "pcie", "memory"},
    3: {"software", "pcie", "memory", "diagnostic", "targeted_stress", "targeted_power", "memory_bandwidth"},
    4: {
        "software",
        "pcie",
        "memory",
        "diagnostic",
        "targeted_stress",
        "targeted_power",
        "memory_bandwidth",
        "memtest",
        "pulse_test",
    },
}
_V3_NAMES = {"gpu_memory": "memory", "pcie": "pcie", "sm_stress": "sm_stress", "diagnostic": "diagnostic"}
_V3_DEPLOYMENT = {
    "blacklist",
    "denylist",
    "nvml_library",
    "cuda_main_library",
    "cuda_toolkit_library",
    "permissions_and_os_blocks",
    "persistence_mode",
    "environment_variables",
    "page_retirement/row_remap",
    "graphics_processes",
    "inforom",
}
CHECK = CheckName.DCGM_DIAG
# Every test name dcgmi prints (4.x plugin names, and 3.x display names once normalised).
_KNOWN_TESTS = set().union(
    *LEVEL_TESTS.values(),
    _V3_NAMES.values(),
    {"software", "sm_stress", "context_create", "nvbandwidth", "eud", "cpu_eud"},
)


def _norm(name: str) -> str:
    key = re.sub(r"\s+", "_", name.strip().lower())
    if key in _V3_DEPLOYMENT:
        return "software"
    return _V3_NAMES.get(key, key)


class UnexpectedDocument(ValueError):
    """A diag document whose shape is not DCGM's: names the field at fault."""


_JSON_NAMES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "true or false",
    type(None): "null",
}


def _json_name(value) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _field(container: dict, key: str, kind: type, where: str, default=None):
    """``container[key]`` if it is a ``kind`` (or absent: ``default``); else UnexpectedDocument."""
    value = container.get(key, default)
    if value is not None and not isinstance(value, kind):
        place = f"{where}.{key}" if where else key
        raise UnexpectedDocument(f"{place}: {_json_name(value)} where DCGM writes {_JSON_NAMES[kind]}")
    return value


def _objects(values: list, where: str) -> list[dict]:
    for i, value in enumerate(values):
        if not isinstance(value, dict):
            raise UnexpectedDocument(f"{where}[{i}]: {_json_name(value)} where DCGM writes an object")
    return values


def _gpu(entry: dict, where: str) -> int | None:
    value = entry.get("entity_id", entry.get("gpu_id"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise UnexpectedDocument(f"{where}.entity_id: {_json_name(value)} where DCGM writes a GPU id")
    try:
        return int(value)
    except ValueError:
        return None


# DCGM's result words. Only Pass passes; Skip is never a pass; anything else (NotRun, Error,
# Running, nothing at all) means the test did not reach a result.
_STATUSES = {"pass", "fail", "skip", "warn"}


def _status(value) -> str | None:
    word = str(value).split(" - ")[0].strip().lower() if isinstance(value, str) else ""
    return word if word in _STATUSES else None


def _problems(entry: dict) -> list[dict]:
    """Errors of a result or summary: 4.x and 3.x call them warnings or errors."""
    found = []
    for key in ("warnings", "errors"):
        value = entry.get(key)
        if isinstance(value, list):
            found += [w for w in value if isinstance(w, dict)]
    return found


def _error_evidence(test: str, gpu: int | None, problem: dict) -> tuple[Verdict, Evidence]:
    severity = problem.get("error_severity")
    verdict = SEVERITY_VERDICT.get(severity, Verdict.FAIL_HARDWARE)
    text = str(problem.get("warning") or problem.get("error") or problem.get("msg") or "").strip()
    where = f"GPU {gpu}" if gpu is not None else "no GPU (entity-less)"
    name = SEVERITY.get(severity, "no severity")
    error_id = problem.get("error_id") if isinstance(problem.get("error_id"), int) else None
    return verdict, Evidence(
        f"{test} on {where}: error {problem.get('error_id')} ({name}): {text[:200]}",
        test=test,
        gpu=gpu,
        error_id=error_id,
        severity=name,
    )


def _tests_from_json(doc) -> list[tuple[str, list[dict], dict]]:
    """(test, per-GPU results, summary) from a 3.x or 4.x document, every field checked for shape:
    NVIDIA publishes no schema, and a truncated or foreign document must not pass for a result."""
    if not isinstance(doc, dict):
        raise UnexpectedDocument(f"a JSON {type(doc).__name__}, not a DCGM diag document")
    body = doc.get("DCGM Diagnostic") or doc.get("DCGM GPU Diagnostic")
    if not isinstance(body, dict):
        raise UnexpectedDocument("no 'DCGM Diagnostic' or 'DCGM GPU Diagnostic' document")
    tests = []
    categories = _field(body, "test_categories", list, "", default=[])
    for c, category in enumerate(_objects(categories, "test_categories")):
        where = f"test_categories[{c}]"
        for t, test in enumerate(
            _objects(_field(category, "tests", list, where, default=[]), f"{where}.tests")
        ):
            here = f"{where}.tests[{t}]"
            name = _field(test, "name", str, here, default="?")
            results = _objects(_field(test, "results", list, here, default=[]), f"{here}.results")
            for r, entry in enumerate(results):
                _gpu(entry, f"{here}.results[{r}]")
            summary = _field(test, "test_summary", dict, here, default={})
            tests.append((_norm(name), results, summary))
    return tests


def _judge_tests(tests: list[tuple[str, list[dict], dict]], level: int | None) -> HealthCheck:
    findings: list[tuple[Verdict, Evidence]] = []

    def add(verdict: Verdict, item: Evidence):
        findings.append((verdict, item))

    for name, results, summary in tests:
        if not results and _status(summary.get("status")) is None:
            shown = f"status {summary['status']!r} is not a result" if summary.get("status") else "no status"
            add(Verdict.TOOL_ERROR, Evidence(f"{name}: {shown} (listed but did not run)", test=name))
            continue
        gpu_failed = False
        for entry in results:
            gpu = _gpu(entry, name)
            status = _status(entry.get("status"))
            if status is None:
                quoted = repr(entry["status"]) if "status" in entry else "missing"
                add(
                    Verdict.TOOL_ERROR,
                    Evidence(
                        f"{name} on GPU {gpu}: status {quoted} is not a result (the test did not reach one)",
                        test=name,
                        gpu=gpu,
                    ),
                )
            elif status == "fail":
                gpu_failed = True
                problems = _problems(entry)
                for problem in problems:
                    add(*_error_evidence(name, gpu, problem))
                if not problems:
                    add(
                        Verdict.FAIL_HARDWARE,
                        Evidence(f"{name} failed on GPU {gpu} without error details", test=name, gpu=gpu),
                    )
            elif status == "skip":
                add(
                    Verdict.TOOL_ERROR,
                    Evidence(f"{name} skipped on GPU {gpu}: a skip is never a pass", test=name, gpu=gpu),
                )
            elif status == "warn":
                add(Verdict.WARN, Evidence(f"{name} warned on GPU {gpu}", test=name, gpu=gpu))
        if _status(summary.get("status")) == "fail" and not gpu_failed:
            problems = _problems(summary)
            texts = " ".join(str(p.get("warning") or p.get("error") or "") for p in problems)
            info = summary.get("info")
            texts += " ".join(str(i) for i in info) if isinstance(info, list) else ""
            if "internal error" in texts.lower() or not problems:
                add(
                    Verdict.TOOL_ERROR,
                    Evidence(
                        f"{name} failed with no GPU to blame ({texts.strip()[:160] or 'no details'}): "
                        "rerun on an exclusive node",
                        test=name,
                    ),
                )
            else:
                for problem in problems:
                    add(*_error_evidence(name, None, problem))
    missing = sorted(LEVEL_TESTS.get(level, set()) - {name for name, _, _ in tests})
    for name in missing:
        add(Verdict.TOOL_ERROR, Evidence(f"expected test {name} did not run (level {level})", test=name))
    if not tests:
        add(Verdict.TOOL_ERROR, Evidence("no test results in the output"))
    verdict = worst(v for v, _ in findings)
    passed = f"{len({name for name, _, _ in tests})} tests passed on every GPU"
    if verdict is Verdict.PASS and level is None:
        # Without the level there is no telling whether every test it runs is in the output.
        return result(
            CHECK, Verdict.WARN, Evidence(f"{passed}, but no --level: not known to be the whole set")
        )
    if verdict is Verdict.PASS:
        return result(CHECK, verdict, Evidence(passed))
    # The worst findings first: the first line is what an operator reads.
    findings.sort(key=lambda f: -f[0].rank)
    return result(CHECK, verdict, *[e for v, e in findings if v is not Verdict.PASS])


_ROW = re.compile(r"^\|\s*(?P<name>[^|]*?)\s*\|\s*(?P<value>[^|]*?)\s*\|\s*$")
_GPU_LINE = re.compile(r"^GPU\s*(\d+)\s*:\s*(\w+)", re.IGNORECASE)
_META = {"dcgm version", "driver version detected", "gpu device ids detected", "number of gpus"}


def classify_diag(
    text: str, exit_code: int | None, level: int | None = None, strict: bool = False
) -> HealthCheck:
    """Verdict for one ``dcgmi diag`` output (JSON with -j, or the text table). A JSON document of a
    shape DCGM does not write is a TOOL_ERROR naming the field, or with ``strict`` (a file a user
    hands over, not a node's answer) an ``UnexpectedDocument``."""
    if exit_code is not None and exit_code not in RAN:
        meaning = TOOL_EXIT.get(exit_code, "not an exit code dcgmi gives with a result")
        return result(
            CHECK,
            Verdict.TOOL_ERROR,
            Evidence(f"dcgmi diag exited {exit_code} ({meaning})"),
            exit_code=exit_code,
        )
    stripped = text.strip()
    if not stripped:
        return result(CHECK, Verdict.TOOL_ERROR, Evidence("dcgmi diag printed nothing"), exit_code=exit_code)
    if stripped.startswith("{"):
        try:
            document = json.loads(stripped)
        except ValueError as e:
            return result(
                CHECK,
                Verdict.TOOL_ERROR,
                Evidence(f"not a whole JSON document ({e}): truncated output?"),
                exit_code=exit_code,
            )
        try:
            judged = judge_document(document, level)
        except UnexpectedDocument as e:
            if strict:
                raise
            return result(
                CHECK, Verdict.TOOL_ERROR, Evidence(f"not a DCGM diag document: {e}"), exit_code=exit_code
            )
    else:
        judged = _judge_tests(_tests_from_text(stripped), level)
    judged.exit_code = exit_code
    return judged


def judge_document(doc: dict, level: int | None) -> HealthCheck:
    """Verdict for a parsed diag document (3.x or 4.x JSON, or what the bindings returned)."""
    return _judge_tests(_tests_from_json(doc), level)


def _tests_from_text(text: str) -> list[tuple[str, list[dict], dict]]:
    """The table ``dcgmi diag`` prints without -j (4.x and the legacy 3.x layout). Warnings are
    rows under their test: they become the test summary's (entity-less) warnings."""
    tests, current, warnings = [], None, []
    for line in text.splitlines():
        match = _ROW.match(line.strip())
        if not match:
            continue
        name, value = match["name"], match["value"]
        lowered = name.lower()
        if lowered in _META or name.startswith(("---", "===", "+")) or value == "Result":
            continue
        if lowered == "warning":
            warnings.append(value)
            continue
        if not name:
            gpu = _GPU_LINE.match(value)
            if gpu and current is not None:
                current[1].append({"entity_id": int(gpu[1]), "status": gpu[2]})
            elif warnings:
                warnings[-1] += value
            continue
        if current is not None and warnings:
            current[2]["warnings"] = [{"warning": w} for w in warnings]
        warnings = []
        status = value.split(" - ")[0].strip()
        if _status(value) is None and _norm(name) not in _KNOWN_TESTS:
            continue  # a table line that is neither a known test nor a result: not a test
        current = (_norm(name), [], {"status": status})
        if value.endswith("- All") or lowered in _V3_DEPLOYMENT:
            current[1].append({"entity_id": None, "status": status})
        tests.append(current)
    if current is not None and warnings:
        current[2]["warnings"] = [{"warning": w} for w in warnings]
    return tests


def gpu_count(text: str) -> int | None:
    """GPUs in ``dcgmi discovery -l`` output ("8 GPUs found.")."""
    match = re.search(r"^(\d+) GPUs? found", text, re.MULTILINE)
    return int(match[1]) if match else None


def nvlink_down(text: str) -> dict[int, list[int]]:
    """Links reported Down per GPU by ``dcgmi nvlink -s`` (U up, D down, X disabled, _ unsupported)."""
    down, gpu = {}, None
    for line in text.splitlines():
        header = re.match(r"\s*gpuId\s+(\d+):", line)
        if header:
            gpu = int(header[1])
            continue
        states = line.split()
        if gpu is not None and states and set(states) <= {"U", "D", "X", "_"}:
            links = [i for i, s in enumerate(states) if s == "D"]
            if links:
                down[gpu] = links
            gpu = None
    return down
