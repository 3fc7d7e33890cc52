"""Imported last by the ranks' forkserver (server/rank_start.py FROZEN_HEAP): the heap it built
importing torch and the rank's modules is moved out of the cyclic collector's reach (gc.freeze) before the
forkserver forks anything, as Python's gc.freeze documentation advises for fork without exec.

A forked process then inherits those ~200,000 objects frozen: its own start-up collection (heap.py
prepare_collector) walks only what it made itself, where it walked them all (about 0.3 s of CPU per forked rank
on a 2-core host), and writing their collector headers copied their memory pages out of the forkserver's.
"""

from __future__ import annotations

from shardserve.server.common.heap import freeze_heap

freeze_heap()
