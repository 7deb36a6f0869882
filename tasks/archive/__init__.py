"""The archive tier: a daily full copy of the promoted checkpoint in an independent store."""
