"""The bulk port's framing (protos/shardserve.proto, BulkSession), shared by server/bulk_reads.py and
client/tcp_reads.py so the two sides cannot drift: all integers little-endian."""
from __future__ import annotations

import struct

TICKET_BYTES = 16                  # the one-time ticket a connection starts with
FRAME = struct.Struct("<II")       # before each request: its kind and length
KIND_READ, KIND_LOOKUP = 1, 2      # a ReadRegionRequest (answer: the box's bytes) or a LookupRequest (a LookupReply)
MAX_REQUEST_BYTES = 8 << 20        # one request frame (a lookup of ~1M ids)
HEADER = struct.Struct("<IIQ")     # before each answer: status (gRPC code, 0 = OK), reserved (0), length
