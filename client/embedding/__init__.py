"""Embedding serving from the client: table views, id planning, the lookup exchange, nn.Module wrappers."""
