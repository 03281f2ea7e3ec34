"""Traffic into sandboxes: forwards HTTP requests routed by ``E2b-Sandbox-Id`` /
``E2b-Sandbox-Port`` headers or by ``{port}-{sandboxID}.{domain}`` host names to a port
inside the guest. It asks the orchestrator where a sandbox lives and must not change any
sandbox state itself.
"""
