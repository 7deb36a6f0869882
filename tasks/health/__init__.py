"""Node health: DCGM diagnostics, GPU basics and nccl-tests, with verdicts operators can act on."""
