"""Child process for the crash and concurrency tests of promotion.

    promote_child.py crash SAVE_DIR ITERATION STEP WHEN      kill -9 itself before/after STEP of write_pointer
    promote_child.py promote SAVE_DIR STEP WHEN N
        the whole promotion; kill -9 at the Nth call of STEP
    promote_child.py fail SAVE_DIR ITERATION STEP            raise inside STEP
    promote_child.py torn SAVE_DIR ITERATION                 kill -9 itself halfway through the write
    promote_child.py hold SAVE_DIR NAME LOCK_TIMEOUT LOG
        promote(); under the lock, print "inside PID" and pause until stdin says go

It runs the real code; only the named step is wrapped.
"""

import os
import signal
import sys
from pathlib import Path

from tasks.checkpoint.pointer import write_pointer  # no torch import: the crash modes start fast
from tasks.storage import local


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def wrap(step, before=None, after=None):
    original = getattr(local, step)

    def wrapped(*args, **kwargs):
        if before:
            before()
        result = original(*args, **kwargs)
        if after:
            after()
        return result

    setattr(local, step, wrapped)


def main(argv):
    mode, save_dir = argv[0], Path(argv[1])
    if mode == "crash":
        iteration, step, when = int(argv[2]), argv[3], argv[4]
        wrap(step, before=die if when == "before" else None, after=die if when == "after" else None)
        write_pointer(save_dir, iteration)
    elif mode == "promote":
        from tasks.checkpoint.promote import promote
        from tasks.checkpoint.state import VerifyOptions

        step, when, nth = argv[2], argv[3], int(argv[4])
        calls = []

        def count_then_die():
            calls.append(1)
            if len(calls) == nth:
                die()

        wrap(
            step,
            before=count_then_die if when == "before" else None,
            after=count_then_die if when == "after" else None,
        )
        promote(save_dir, VerifyOptions(job="test"), 10)
    elif mode == "fail":
        iteration, step = int(argv[2]), argv[3]

        def boom():
            raise OSError(28, "No space left on device")

        wrap(step, before=boom)
        write_pointer(save_dir, iteration)
    elif mode == "torn":
        iteration = int(argv[2])
        real_write = os.write

        def half_then_die(fd, data):
            real_write(fd, bytes(data[: max(1, len(data) // 2)]))
            die()

        local.os.write = half_then_die
        write_pointer(save_dir, iteration)
    elif mode == "hold":
        from tasks.checkpoint import promote as promote_module
        from tasks.checkpoint.state import VerifyOptions
        from tasks.errors import CkptopsError

        name, lock_timeout, log = argv[2], float(argv[3]), Path(argv[4])
        first_step, last_step = promote_module.pending, promote_module.choose_target

        def note(event):
            with open(log, "a") as f:
                f.write(f"{name}-{event}\n")

        def entered(*args, **kwargs):  # the first step under the lock
            note("enter")
            print("inside", os.getpid(), flush=True)  # the holder the lock names
            sys.stdin.readline()
            return first_step(*args, **kwargs)

        def leaving(*args, **kwargs):  # the last decision under the lock
            result = last_step(*args, **kwargs)
            note("exit")
            return result

        promote_module.pending, promote_module.choose_target = entered, leaving
        try:
            promote_module.promote(save_dir, VerifyOptions(job="test"), lock_timeout)
        except CkptopsError as e:
            print(f"error: {e}", flush=True)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
