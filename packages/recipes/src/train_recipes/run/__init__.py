"""A run on disk and in time.

The run folder and its lock, checkpoints and resume, disk estimates, save failures,
preemption signals, how far a run's end got, process-group start-up and the setup every
recipe shares (``runtime``).
"""
