"""Events a training job posts to Prefect, posted as a job posts them: plain HTTP, no Prefect
client (the local job's ``infra/local_job/records.notify_saved`` is the product's own)."""

import json
import urllib.request
import uuid
from datetime import UTC, datetime

from tasks.events import CHECKPOINT_SAVED, job_resource


def post_saved(api_url: str, job: str, iteration: int) -> int:
    """``training.checkpoint.saved`` for ``job`` at ``iteration``; the reply's HTTP status."""
    event = {
        "id": str(uuid.uuid4()),
        "occurred": datetime.now(UTC).isoformat(),
        "event": CHECKPOINT_SAVED,
        "resource": {"prefect.resource.id": job_resource(job)},
        "payload": {"iteration": iteration},
    }
    request = urllib.request.Request(
        f"{api_url}/events", json.dumps([event]).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.status
