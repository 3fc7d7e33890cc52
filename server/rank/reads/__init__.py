"""The rank's read paths besides plain ReadRegion: small unary reads, the bulk TCP port, shared memory, lookups."""
