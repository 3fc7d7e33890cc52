"""The coordinator process: CoordinatorServer (server.py) builds its parts: the catalog of records, the rank
registry and calls to ranks, the tensor lifecycle, collective jobs, the reshard, checkpoint, snapshot and repair
drivers, and the upkeep, behind its thin gRPC servicer. It never imports server.rank."""
