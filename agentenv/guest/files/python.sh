#!/.aenv/bin/busybox sh
# The bundled CPython, run through its own dynamic loader and libraries so it works on any
# root filesystem (even one without glibc). PYTHONHOME/PYTHONPATH are set for this process
# only; envd removes them from the environment of the processes it starts.
case "$0" in */*) here=${0%/*} ;; *) here=. ;; esac
root=$(cd "$here/.." && pwd) || exit 127
py=$root/python
export PYTHONHOME="$py/usr" PYTHONPATH="$root/site-packages" PYTHONNOUSERSITE=1
export PYTHONDONTWRITEBYTECODE=1
exec "$py/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --inhibit-cache \
	--library-path "@LIBRARY_PATH@" "$py/usr/bin/python3.11" -s "$@"
