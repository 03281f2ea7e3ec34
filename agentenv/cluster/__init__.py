"""Many nodes: the scheduler (``scheduler``: node registry from heartbeats, placement,
sandbox->node bindings, all kept in memory or in Redis by ``store``, where several
replicas can share them), the stateless gateway (``gateway``: the one URL clients use,
served by ``gateway_server``; a sandbox's traffic is relayed byte for byte by its
``front`` over ``upstreams``' pooled connections, to the node ``routes`` keeps for each
sandbox; what its app relays itself, the control plane's routes, goes by ``traffic``
over ``node_transport``'s connection pool),
the node's heartbeat client (``heartbeat``), TLS between them (``tls``, ``local_ca``)
and a local cluster launcher (``local``). It must
not change sandbox state except through node APIs: the gateway forwards requests to
nodes, and the heartbeat only reads the orchestrator's views.
"""
