#!/.aenv/bin/busybox sh
# Start the in-guest agent on the bundled Python (see bin/python). busybox is named
# explicitly so the tools tree also runs from a host directory during the build checks.
case "$0" in */*) here=${0%/*} ;; *) here=. ;; esac
exec "$here/busybox" sh "$here/python" -m agentenv.envd --port @ENVD_PORT@ --control-port @ENVD_CONTROL_PORT@ \
	--state-file /run/aenv/envd-state.json "$@"
