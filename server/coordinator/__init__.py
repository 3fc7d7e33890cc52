"""The coordinator process: CoordinatorServer (server.py) builds its parts behind its thin gRPC servicer
(service.py, its requests checked into orders by requests.py): the catalog of records (catalog/), the rank
registry and calls to ranks (ranks/), the drivers of the tensor lifecycle, snapshots, reshards, checkpoints and
repair (drivers/), and the upkeep (upkeep.py). It never imports server.rank."""
