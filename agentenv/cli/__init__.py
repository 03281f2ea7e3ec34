"""The ``aenv`` command line: talks to the HTTP API only, never to internals."""
