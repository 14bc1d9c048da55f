"""The names of the scheduling policies, on neutral ground.

Owns only the tuple of names that `EngineConfig` validates and that
`engine/request_queue.py` implements. It lives outside engine/ so that the configuration
(which the runner reads) never imports the engine; it must never import a layer.
"""

SCHEDULING_POLICIES = ("fcfs", "priority")
