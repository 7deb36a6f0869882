"""The error types every layer shares, by what they are:

- ``CkptopsError``: an expected failure (a check or a step failed), exit 1;
- ``UsageError``: bad input from the caller (a path that is not there, a bad value), exit 2;
- ``Unreadable``: the environment kept ckptops from reading or writing (permissions, I/O), exit
  2; made from an ``OSError`` in one place, ``unreadable()``;
- ``Malformed``: a file ckptops reads is there but not what it should be, exit 2;
- anything else is a fault in ckptops, and shows as one (a traceback).

Each message is one line naming the file, node, key or check at fault, and the CLI prints it
without a traceback.
"""


class CkptopsError(Exception):
    """An expected failure with a one-line, actionable message."""

    exit_code = 1


class UsageError(CkptopsError):
    """Bad input from the caller: a path that is not there, a bad profile value, a bad flag."""

    exit_code = 2


class Unreadable(CkptopsError):
    """The environment kept us from reading or writing (permissions, I/O errors).

    Kept apart from a failed check on purpose: a permission problem or a flaky mount says nothing
    about the checkpoint, so it must never be recorded as the checkpoint being invalid. Nor is it
    the caller's mistake: it is not a ``UsageError``.
    """

    exit_code = 2


class Malformed(CkptopsError):
    """A file ckptops reads is there but not what it should be (a pointer, a hold, a manifest, a
    stored baseline): one line naming the file and what is wrong with it, exit 2."""

    exit_code = 2


class LockTimeout(CkptopsError):
    """Another run holds the job's lock for longer than we were willing to wait."""


def unreadable(path, error: OSError) -> Unreadable:
    return Unreadable(f"{path}: {error.strerror or error}")


class Interrupted(BaseException):
    """A signal (SIGTERM from ``timeout``, systemd or Prefect; SIGINT) asked a long run to end.
    A ``BaseException``, like ``KeyboardInterrupt``: no ``except Exception`` may swallow it, and
    every ``finally`` on the way out runs."""

    def __init__(self, signum: int):
        import signal

        self.signum = signum
        super().__init__(signal.Signals(signum).name)
