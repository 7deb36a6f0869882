"""Where checkpoints live. The shared store is a POSIX mount (Lustre, GPFS, NFS or a local disk);
the archive (a later issue) is an object store reached through the same small interface."""
