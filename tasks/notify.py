"""Telling a person: a message through the Prefect notification block the profile names
(``notify.block``, e.g. ``slack-webhook/ckptops-oncall`` or ``custom-webhook/pager``).

A notification is best effort: a missing block or an unreachable receiver must never turn a
finished run into a failed one (the run's own state and summary still say what happened), so
``send`` returns what went wrong instead of raising, and the caller puts that in its summary.
"""

from tasks.errors import UsageError


def run_link() -> str:
    """The UI link of the flow run we are in, as the run's own "View at" log line gives it
    ('' outside a flow run)."""
    from prefect.runtime import flow_run
    from prefect.utilities.urls import url_for

    return (url_for("flow-run", obj_id=flow_run.id) or "") if flow_run.id else ""


def send(profile, subject: str, body: str) -> str | None:
    """Send ``subject`` and ``body`` (with the run's UI link) through ``notify.block``; None when
    sent or when the profile names no block, else why it was not sent (one line)."""
    if profile.notify is None or not profile.notify.block:
        return None
    from prefect.blocks.core import Block

    link = run_link()
    text = f"[{profile.job.name}] {body}" + (f"\n{link}" if link else "")
    try:
        block = Block.load(profile.notify.block)
        block.notify(body=text, subject=f"ckptops {profile.job.name}: {subject}")
    except (ValueError, UsageError) as e:  # Prefect: "Unable to find block document named ..."
        return f"notification not sent: block {profile.notify.block!r}: {str(e).splitlines()[0]}"
    except Exception as e:  # the receiver's failure (HTTP status, refused, timeout) is not ours
        return f"notification not sent through {profile.notify.block!r}: {type(e).__name__}: {str(e)[:200]}"
    return None


def block_id(profile):
    """The id of the profile's notification block (for a server automation's action), or None
    without one; a block that does not exist is one line naming it."""
    if profile.notify is None or not profile.notify.block:
        return None
    from prefect.blocks.core import Block

    try:
        return Block.load(profile.notify.block)._block_document_id
    except ValueError as e:
        raise UsageError(f"{profile.source}: notify.block {profile.notify.block!r}: {e}") from None
