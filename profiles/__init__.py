"""The profiles shipped with ckptops (one YAML per cluster or job), read with importlib.resources
so that an installed ckptops finds them as a checkout does."""
