"""The names of the Prefect events ckptops emits and listens for, and the resource they are about.

The bottom of the package: it imports nothing from tasks/, so every emitter (the flows' tasks),
every listener (the watchdog's and the recovery's automations) and the tests name an event the
same way (infra/prefect.yaml's triggers spell theirs out: YAML imports nothing). Every event about
a job has the resource ``job_resource``.

Posted by the training job (infra/local_job/records.py, its epilog), not by ckptops:
``CHECKPOINT_SAVED`` after each save, ``JOB_FAILED`` when the job fails.
"""

CHECKPOINT_SAVED = "training.checkpoint.saved"
JOB_FAILED = "training.job.failed"

# Emitted by verify-and-promote when the pointer names the newest complete checkpoint: what the
# promotion alarm waits for after a save.
CHECKPOINT_PROMOTED = "ckptops.checkpoint.promoted"

RECOVERY_STARTED = "training.recovery.started"
# RECOVERY_STARTED's resource label: whose failure the recovery is about, "job" or
# "infrastructure" (a preemption, a maintenance, a planned swap): the failure-storm guard counts
# the job's own only.
CAUSE_LABEL = "ckptops.cause"
RECOVERY_STOPPED = "training.recovery.stopped"
RECOVERY_COMPLETED = "training.recovery.completed"

RESUME_VALIDATED = "training.resume.validated"
RESUME_REJECTED = "training.resume.rejected"


def job_resource(job: str) -> str:
    """The resource id of every event about ``job``."""
    return f"ckptops.job.{job}"


def flow_run_event(state: str) -> str:
    """Prefect's own event for a flow run entering ``state`` (or ``heartbeat``)."""
    return f"prefect.flow-run.{state}"
