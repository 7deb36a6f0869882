"""Stand-in for DCGM's Python bindings (no GPU here): only what ckptops calls."""

DCGM_OPERATION_MODE_AUTO = 1
