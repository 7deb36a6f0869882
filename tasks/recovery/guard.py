"""What keeps a recovery safe from signals: SIGTERM ends it cleanly (the incident is closed on
the way out), and SIGTERM and SIGINT wait while a relaunch is submitted and recorded.
"""

import signal
import threading
from contextlib import contextmanager

from tasks.errors import Interrupted


@contextmanager
def sigterm_ends_the_run():
    """SIGTERM (what ``timeout``, systemd and Prefect send) raises ``Interrupted`` in the main
    thread, so the incident is closed on the way out; SIGINT already raises KeyboardInterrupt.
    Left alone where someone else handles SIGTERM (Prefect's flow engine raises its own
    TerminationSignal, a BaseException too) or off the main thread."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def _raise(signum, frame):
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def signals_held():
    """SIGTERM and SIGINT wait while a relaunch is submitted and recorded: the job and the
    ledger line naming it go together. A signal that came meanwhile is delivered after, to the
    handler that was in place (ours, Prefect's, or the default)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for number in previous:
        signal.signal(number, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in pending:
            signal.raise_signal(number)


def signal_name(error: BaseException) -> str:
    number = getattr(error, "signum", None) or getattr(error, "signal", None)
    if isinstance(number, int):
        return signal.Signals(number).name
    return "SIGINT" if isinstance(error, KeyboardInterrupt) else type(error).__name__


# The states in which a relaunch can be adopted (watched to its resume): not one that ends.


def who(owner: dict | None) -> str:
    if not owner:
        return "a recovery run"
    return f"the recovery run (pid {owner.get('pid')} on {owner.get('host')})"
