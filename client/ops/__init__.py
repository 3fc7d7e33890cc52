"""Cluster-wide operations the coordinator drives: reshard, row updates, DCP checkpoints."""
