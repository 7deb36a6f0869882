"""Where checkpoints live. The shared store is a POSIX mount (Lustre, GPFS, NFS or a local disk);
the archive is an object store (or a directory) reached through fsspec (``archive.py``)."""
