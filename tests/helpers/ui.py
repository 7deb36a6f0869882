"""What a person sees in the Prefect UI after ``make demo``, looked at in headless Chromium:
the checks the browser test makes, and the screenshots the README shows (``make screenshots``
refreshes them from the demo's server).

    python -m tests.helpers.ui API_URL OUT_DIR
"""

import json
import sys
import urllib.request
from pathlib import Path


def _latest(client, key: str):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    found = client.read_artifacts(
        artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
        sort=ArtifactSort.CREATED_DESC,
        limit=1,
    )
    if not found:
        raise AssertionError(f"no artifact {key!r} on the server")
    return found[0]


def look(api_url: str, out: Path, job: str = "local-tiny") -> dict[str, str]:
    """Open each page, wait until it shows what it must, screenshot it; the pages' texts."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.helpers.browser import Browser

    ui = api_url.removesuffix("/api")
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        recovery = client.read_deployment_by_name(f"recovery-run/{job}-recovery")
        verify = client.read_deployment_by_name(f"verify-and-promote/{job}")
        health_deployment = client.read_deployment_by_name("node-health/local-health")
        count = len(client.read_deployments())
    # The UI in the browser must call this server's API (Prefect's default is port 4200's).
    with urllib.request.urlopen(f"{ui}/ui-settings", timeout=10) as reply:
        settings = json.loads(reply.read())
    if settings["api_url"] != api_url:
        raise AssertionError(f"{ui}: its UI calls {settings['api_url']}, not {api_url}")
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        checks = _latest(client, f"verify-checks-{job}")
        tensors = _latest(client, f"verify-tensors-{job}")
        run_name = client.read_flow_run(checks.flow_run_id).name
        trend = _latest(client, f"drill-trend-{job}")
        health = _latest(client, "node-health")
        incidents = _latest(client, f"incidents-{job}")
        timeline = _latest(client, f"incident-timeline-{job}")
    seen: dict[str, str] = {}
    browser = Browser()
    try:
        # Deployments: every one (the list shows a page of them), and the job's own with their
        # schedules.
        seen["deployments"] = browser.open(f"{ui}/deployments", [f"{count} Deployments", job])
        browser.screenshot(out / "deployments.png")
        seen["verify-deployment"] = browser.open(
            f"{ui}/deployments/deployment/{verify.id}", [job, "Every 30 seconds"]
        )
        seen["health-deployment"] = browser.open(
            f"{ui}/deployments/deployment/{health_deployment.id}", ["local-health", "At 02:15 AM every day"]
        )
        seen["recovery-deployment"] = browser.open(
            f"{ui}/deployments/deployment/{recovery.id}",
            [f"{job}-recovery", "Run", "Triggers", f"{job}-recovery__automation_1"],
        )
        # A verify-and-promote run: its artifacts are the checks table and the summary.
        # The run's page is reached as a person reaches it: from the artifact, by its run link.
        browser.open(f"{ui}/artifacts/artifact/{checks.id}", [f"verify-checks-{job}", run_name])
        browser.click_text(run_name)
        browser.open_text(["Artifacts", "verify-and-promote"])
        browser.click_text("Artifacts")
        seen["verify-run"] = browser.open_text([f"verify-checks-{job}", f"verify-summary-{job}"])
        seen["verify-checks"] = browser.open(
            f"{ui}/artifacts/artifact/{checks.id}", [f"verify-checks-{job}", "iteration", "crc", "pass"]
        )
        browser.screenshot(out / "verify-checks.png")
        # The worst tensors of each checkpoint verified: the values behind the values check.
        seen["verify-tensors"] = browser.open(
            f"{ui}/artifacts/artifact/{tensors.id}",
            [f"verify-tensors-{job}", "norm change", "nan", "float32"],
        )
        browser.screenshot(out / "verify-tensors.png")
        # The drill trend: a plot that really decoded, not a broken image.
        seen["drill-trend"] = browser.open(f"{ui}/artifacts/artifact/{trend.id}", [f"restore drills: {job}"])
        browser.wait_images(1)
        browser.screenshot(out / "drill-trend.png")
        # Node health: the per-node table (the run's state message above it names the node and
        # the verdict too, shortened: wait for the table's own evidence).
        seen["node-health"] = browser.open(
            f"{ui}/artifacts/artifact/{health.id}", ["localhost", "FAIL_CONFIG", "no GPUs found"]
        )
        browser.screenshot(out / "node-health.png")
        # The incident: its row and its phase timeline.
        seen["incidents"] = browser.open(f"{ui}/artifacts/artifact/{incidents.id}", ["hardware", "completed"])
        browser.screenshot(out / "incidents.png")
        seen["incident-timeline"] = browser.open(
            f"{ui}/artifacts/artifact/{timeline.id}", [f"incidents: {job}"]
        )
        browser.wait_images(1)
        browser.screenshot(out / "incident-timeline.png")
    finally:
        browser.close()
    return seen


if __name__ == "__main__":
    look(sys.argv[1], Path(sys.argv[2]))
    print(f"screenshots in {sys.argv[2]}")
