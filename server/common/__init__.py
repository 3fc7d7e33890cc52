"""Code both server processes share: auth, errors, gRPC plumbing, request checks, CLI flags, DCP metadata.

It imports neither server.coordinator nor server.rank."""
