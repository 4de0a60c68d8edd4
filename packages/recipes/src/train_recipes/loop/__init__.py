"""The training loop of every recipe (``drive``) and what it reports.

Metrics, trackers, run health, the length and learning-rate schedule, and throughput (FLOPs,
MFU).
"""
