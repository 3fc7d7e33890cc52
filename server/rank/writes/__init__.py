"""The write half of the rank's data paths (WritePath, writes/path.py): shard streams, batches of whole
shards with their bytes inline, from a same-host writer's memfd, or following the request on the bulk port,
and row rewrites."""
