"""The read half of the rank's data paths (ReadPath, reads/path.py) and the servicers that use it: small
unary reads, batches of boxes, the bulk TCP port, shared memory, lookups."""
