"""The only owner of sandbox state.

Creates sandboxes by restoring template snapshots, tracks them in SQLite under the data
directory, expires them on TTL, kills them and cleans up after crashes. It drives the VMM,
network and guest layers through their public interfaces and never reaches into their
internals; nothing else in agentenv changes sandbox state.
"""
