"""The one bounded poll the tests use where a server, a worker or a cluster acts on its own.

Never a sleep as synchronisation: each poll asks for the state it waits for, and has a deadline.
"""

import os
import select
import time


def within(condition, timeout: float, every: float = 0.2):
    """``condition()``'s first true value within ``timeout`` seconds, or None."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value or None
        time.sleep(every)


def until(condition, timeout: float, what: str, every: float = 0.2):
    """``condition()``'s first true value; an AssertionError naming ``what`` if none came within
    ``timeout`` seconds."""
    value = within(condition, timeout, every)
    if value is None:
        raise AssertionError(f"not within {timeout:.0f}s: {what}")
    return value


def line_from_fifo(fifo, timeout: float, what: str) -> str:
    """The first line a process writes into the FIFO ``fifo`` (a child says it runs, and its pid),
    waited for with ``select``; an AssertionError naming ``what`` if none came within ``timeout``
    seconds of silence."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        text = b""
        while not text.endswith(b"\n"):
            assert select.select([fd], [], [], timeout)[0], f"not within {timeout:.0f}s: {what}"
            text += os.read(fd, 64)
    finally:
        os.close(fd)
    return text.decode()
