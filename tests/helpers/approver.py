"""The approver of a paused recovery run, as a person at the UI would be: wait until a flow run
is paused, read its form's description, answer with input through ``resume_flow_run``."""

import contextvars
import threading


def answer_when_paused(answer: dict, seen: dict) -> threading.Thread:
    """In a thread: the first paused flow run gets ``answer``; ``seen["form"]`` is the form's
    description. Set ``seen["done"]`` to stop waiting when the run ended without pausing."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.flow_runs import resume_flow_run
    from prefect.input import keyset_from_paused_state

    def run():
        with get_client(sync_client=True) as client:
            paused = []
            while not paused and not seen.get("done"):
                paused = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(
                        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED]))
                    )
                )
                threading.Event().wait(0.5)
            if paused:
                keyset = keyset_from_paused_state(paused[0].state)
                seen["form"] = client.read_flow_run_input(paused[0].id, keyset["description"])
                resume_flow_run(paused[0].id, run_input=answer)

    # In the caller's Prefect settings (a context variable, which a new thread does not inherit).
    thread = threading.Thread(target=contextvars.copy_context().run, args=(run,), daemon=True)
    thread.start()
    return thread
