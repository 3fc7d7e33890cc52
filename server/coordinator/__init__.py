"""The coordinator process: rank registry, name locks, catalog, tensor lifecycle, collective jobs, and the
reshard and checkpoint drivers behind its thin gRPC servicer. It never imports server.rank."""
