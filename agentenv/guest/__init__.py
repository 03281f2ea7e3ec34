"""Guest image pipeline: the guest kernel and initramfs, the read-only tools drive (envd
plus a self-contained Python runtime) and the base root filesystem, all built from Debian
packages into a content-addressed cache, plus the computed kernel command line. It builds
files; it never starts VMs or touches sandbox state.
"""
