"""The coordinator's view of its ranks: the registry of who is registered and alive (registry.py, info.py),
calls fanned out to them (calls.py), their wire messages (messages.py) and the health of the copies they hold
(health.py).
"""
