"""Guest image pipeline: the guest kernel and initramfs, the read-only tools drive (envd
plus a self-contained Python runtime) and the base root filesystem, all built from Debian
packages into a content-addressed cache, plus the computed kernel command line. It builds
files; it never starts VMs or touches sandbox state.
"""

from agentenv.guest.cmdline import kernel_cmdline
from agentenv.guest.errors import GuestImageError, GuestImageMissing, HostToolMissing
from agentenv.guest.image import (
    GuestImage,
    build_guest_image,
    default_cache_dir,
    find_guest_image,
    load_guest_image,
)

__all__ = [
    "GuestImage",
    "GuestImageError",
    "GuestImageMissing",
    "HostToolMissing",
    "build_guest_image",
    "default_cache_dir",
    "find_guest_image",
    "kernel_cmdline",
    "load_guest_image",
]
