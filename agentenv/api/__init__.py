"""HTTP control plane: the E2B-compatible REST API served by FastAPI.

Owns request/response models (Pydantic, which generate the OpenAPI document), API-key
authentication and the mapping of orchestrator errors to JSON ``{code, message}`` bodies.
It never touches VMs, networks or files directly: every state change goes through the
orchestrator.
"""
