"""Virtual machine monitors: one async driver interface (boot, pause, save state, restore,
stop, kill, stats) with QEMU ``-M microvm`` (QMP) and Firecracker (API socket)
implementations, plus the accelerator probe. Drivers manage one VMM process each and know
nothing about sandboxes, templates, networks beyond a tap name, or the database. Every
VMM process is started by :mod:`agentenv.vmm.launch`. What restored guests touch first
of a snapshot's RAM file is recorded and read ahead by :mod:`agentenv.vmm.working_set`.
"""
