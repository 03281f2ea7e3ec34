"""HTTP control plane: the E2B-compatible REST API served by FastAPI.

Owns request/response models (Pydantic, which generate the OpenAPI document), API-key
authentication, the mapping of orchestrator errors to JSON ``{code, message}`` bodies, and
the HTTP/1.1 protocol every agentenv server hands uvicorn (JSON errors for requests it
cannot parse, a bounded request head).
It never touches VMs, networks or files directly: every state change goes through the
orchestrator.
"""
