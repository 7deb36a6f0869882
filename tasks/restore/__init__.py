"""Restore drills: really restore a checkpoint, really load it, time every phase."""
