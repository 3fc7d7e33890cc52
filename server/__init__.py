"""shardserve servers: `common/` (shared), `coordinator/` and `rank/` (one package per process), and the
launcher that assembles them (`python -m shardserve.server up|coordinator|--coordinator ...`)."""
