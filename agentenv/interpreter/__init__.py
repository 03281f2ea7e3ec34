"""The in-guest code interpreter: the server on port 49999 that the unmodified
``e2b-code-interpreter`` SDK talks to (streaming ``POST /execute``, ``/contexts``).

It owns the guest's execution contexts: a Jupyter kernel (ipykernel, driven through
jupyter_client) per Python context and a long-lived bash process per bash context, the
NDJSON lines the SDK parses (``wire.py``), and nothing else. It runs inside the sandbox on
the guest's own Python, from the ``code-interpreter-v1`` template's root filesystem
(``agentenv/guest/interpreter.py`` builds it); like ``envd`` it imports nothing from
agentenv outside itself.
"""
