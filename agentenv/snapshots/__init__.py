"""Snapshot records: the on-disk layout and metadata of template and sandbox snapshots
(device state, memory image, disk, and the VMM/accelerator they need). It reads and writes
snapshot directories atomically and never starts or stops VMs.
"""
