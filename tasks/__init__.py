"""ckptops: the work itself, by domain, as plain Python that runs and tests without Prefect."""

__version__ = "0.1.0"
