"""The TLS tests' throw-away certificate authority, which ``scripts/cluster up --tls``
uses too (it lives in ``agentenv.cluster.local_ca``)."""

from agentenv.cluster.local_ca import LocalCA, make_local_ca

__all__ = ["LocalCA", "make_local_ca"]
