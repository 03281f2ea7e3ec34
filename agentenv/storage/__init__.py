"""Disk images and file clones for sandboxes: read-only shared bases, per-sandbox
copy-on-write overlays, sealed layers and their flattening, raw views of qcow2 chains for
VMMs without qcow2, reflinks (or sparse copies) of RAM files, and root filesystems made
from OCI images. It creates and removes files and knows nothing about VMs or sandboxes.
"""
