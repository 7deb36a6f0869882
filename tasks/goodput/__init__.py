"""Goodput: effective training time measured from the job's records and incidents, and
checkpoint-interval advice from its own save cost and failure rate."""
