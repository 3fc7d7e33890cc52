"""The read paths of the data plane (gRPC, bulk TCP, shared memory) and the policy that picks one per rank."""
