"""Scale-out: KV-event-fed router, graph-aware placement, and replicas as Ray actors.

Importing this package never imports Ray; `runtime.cluster.ray_support` does, on first use.
"""
