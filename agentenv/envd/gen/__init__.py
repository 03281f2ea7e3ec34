"""Generated protobuf-py messages and connectrpc stubs; regenerate with
scripts/gen-envd-protos, never edit by hand."""
