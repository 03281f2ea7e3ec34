"""Disk images and file clones for sandboxes: read-only shared bases, per-sandbox
copy-on-write overlays, sealed layers and their flattening, and reflinks (or sparse
copies) of RAM files. It creates and removes files and knows nothing about VMs or
sandboxes.
"""
