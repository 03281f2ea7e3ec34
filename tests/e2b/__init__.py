"""The official E2B Python SDK driven against a live agentenv server."""
