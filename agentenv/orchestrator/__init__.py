"""The only owner of sandbox state.

Creates sandboxes by restoring template snapshots, tracks them in SQLite under the data
directory, expires them on TTL, pauses, snapshots, forks and kills them, commits
snapshots, templates and paused sandboxes to the repository and adopts sandboxes paused
on other nodes, runs template builds, keeps template tags in the repository, and cleans
up after crashes. It drives the VMM, network, storage, snapshot and guest layers through
their public interfaces and never reaches into their internals; nothing else in agentenv
changes sandbox state.
"""
