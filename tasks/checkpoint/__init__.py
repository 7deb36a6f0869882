"""Checkpoint verification, manifests, promotion and retention for Megatron torch_dist saves."""
