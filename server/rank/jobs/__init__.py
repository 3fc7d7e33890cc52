"""Collective jobs on a rank: ordering, the RunCollective service, and the reshard and checkpoint job kinds."""
