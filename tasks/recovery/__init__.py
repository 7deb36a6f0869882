"""Recovery of a failed training job: triage, stop rules, checkpoint and nodes, relaunch, validation."""
