"""shardserve servers: `common/` (shared), `coordinator/` and `rank/` (one package per process), and the
modules that assemble them (`python -m shardserve.server up|coordinator|node|--coordinator ...`)."""
