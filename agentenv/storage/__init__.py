"""Disk images for sandboxes: read-only shared bases and per-sandbox copy-on-write
overlays. It creates and removes image files and knows nothing about VMs or sandboxes.
"""
