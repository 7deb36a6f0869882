"""Child process for the archive crash test: upload the first file, then die with SIGKILL.

    archive_child.py PROFILE

Runs the real archive_checkpoint; only ArchiveStore.put_files (a local directory) and
ArchiveStore.put_checked_files (S3) are wrapped.
"""

import os
import signal
import sys

from tasks.archive.copy import archive_checkpoint
from tasks.profile import load_profile
from tasks.storage.archive import ArchiveStore

real_put_files = ArchiveStore.put_files
real_put_checked_files = ArchiveStore.put_checked_files


def first_file_then_die(self, pairs, progress=None):
    real_put_files(self, pairs[:1], progress)
    os.kill(os.getpid(), signal.SIGKILL)


def first_checked_file_then_die(self, items, hashing, progress=None):
    real_put_checked_files(self, items[:1], hashing, progress)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    ArchiveStore.put_files = first_file_then_die
    ArchiveStore.put_checked_files = first_checked_file_then_die
    profile = load_profile(sys.argv[1])
    archive_checkpoint(profile.job.save_dir, profile, force=True)
