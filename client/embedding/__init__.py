"""Embedding serving from the client: table views, id planning, the lookup exchange, mapped rows, row cache
(the drop-in nn.Modules over them are client.nn)."""
