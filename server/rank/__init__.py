"""One shard-server rank process: its store, the ShardServer servicer, collective jobs and read paths.
It never imports server.coordinator."""
