"""The `shardserve` command line (client.cli.main:main)."""
