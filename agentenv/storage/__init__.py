"""Disk images and file clones for sandboxes: read-only shared bases, per-sandbox
copy-on-write overlays, sealed layers and their flattening, raw views of qcow2 chains for
VMMs without qcow2, reflinks (or sparse copies) of RAM files, and root filesystems made
from OCI images, and volume images with the file operations the volume content API runs
on them (``volume_tree.py``, standard library only: guests run it too). It creates and
removes files and knows nothing about VMs or sandboxes.
"""
