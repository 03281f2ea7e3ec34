"""Snapshots and the repository they are kept in: the on-disk layout of a machine
snapshot (device state, RAM image, disk, the VMM and accelerator they need), the durable
repository (object stores for a posix directory or S3, content-addressed chunked blobs,
catalog records, names and template tags), the bounded node-local cache over it, and
moving snapshots between a node and the repository. It reads and writes files and
objects; it never starts or stops VMs and never changes sandbox state (the orchestrator
decides what is committed, fetched or evicted, and when).
"""
