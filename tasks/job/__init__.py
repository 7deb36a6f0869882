"""The training job's own records, read back: its step records or its Megatron log (one reader)."""
