"""Many nodes: the scheduler (``scheduler``: node registry from heartbeats, placement,
sandbox->node bindings, all kept in memory or in Redis by ``store``, where several
replicas can share them), the stateless gateway (``gateway``: the one URL clients use;
its data path, a request relayed to a node and the answer back, is ``traffic``, over
``node_transport``'s connection pool, to the node ``routes`` keeps for each sandbox),
the node's heartbeat client (``heartbeat``), TLS between them (``tls``, ``local_ca``)
and a local cluster launcher (``local``). It must
not change sandbox state except through node APIs: the gateway forwards requests to
nodes, and the heartbeat only reads the orchestrator's views.
"""
