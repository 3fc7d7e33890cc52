"""The coordinator's drivers: each takes an order and carries it out over the catalog and the ranks (the
tensor lifecycle, snapshots, reshards, checkpoints, repair, row-update groups), with what they share
(context.py: one DriverContext; locks, quotas, collective jobs and their rendezvous).
"""
