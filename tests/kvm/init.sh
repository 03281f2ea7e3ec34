#!/bin/sh
# The KVM test host's init. The guest image's initramfs mounts the host's root filesystem
# (/dev/vda) and the payload disk (/dev/vdb) at /.aenv, then runs this script (as
# /.aenv/bin/aenv-init, under catatonit) exactly as it would a sandbox's aenv-init: the host
# reuses the guest kernel and initramfs unchanged. It mounts the kernel filesystems, loads
# KVM, mounts the reflink-capable data disk (/dev/vdc, XFS), binds the payload (checkout,
# virtualenv, Firecracker, guest image) at the paths it has outside, and runs the agent.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
say() { echo "KVMHOST-INIT: $*" > /dev/console; }

mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
mkdir -p /dev/pts /dev/shm
mount -t devpts -o nosuid,noexec,gid=5,mode=0620,ptmxmode=0666 devpts /dev/pts
[ -e /dev/ptmx ] || ln -s pts/ptmx /dev/ptmx
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /dev/shm
mount -t cgroup2 -o nosuid,nodev,noexec,nsdelegate cgroup2 /sys/fs/cgroup
mount -t tmpfs -o nosuid,nodev,mode=0755 tmpfs /run
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
say "started uptime=$(cut -d' ' -f1 /proc/uptime)"

mount -o remount,rw /.aenv || say "cannot remount the payload read-write"
hostname kvmhost
ip link set lo up

# SVM (AMD, what TCG's -cpu max emulates) or VMX; nested paging comes with either.
if grep -qw svm /proc/cpuinfo; then
	modprobe kvm_amd || say "modprobe kvm_amd failed"
elif grep -qw vmx /proc/cpuinfo; then
	modprobe kvm_intel || say "modprobe kvm_intel failed"
fi
for module in xfs tun vhost_net vhost_vsock overlay fuse veth bridge br_netfilter nf_tables; do
	modprobe "$module" 2>/dev/null || say "cannot load module $module"
done
[ -c /dev/kvm ] && say "kvm: /dev/kvm ready" || say "kvm: no /dev/kvm"

mkdir -p /data
mount -t xfs /dev/vdc /data || say "cannot mount the data disk /dev/vdc"
mkdir -p /data/tmp
chmod 1777 /data/tmp
mount --bind /data/tmp /tmp

# The payload's files appear where they are outside (paths listed in /.aenv/binds).
while read -r path; do
	[ -n "$path" ] || continue
	mkdir -p "$path"
	mount --bind "/.aenv/root$path" "$path" || say "cannot bind $path"
done < /.aenv/binds

say "ready uptime=$(cut -d' ' -f1 /proc/uptime)"
while true; do
	/usr/bin/python3 /.aenv/agent.py > /dev/console 2>&1
	say "agent exited with $?; restarting"
	sleep 1
done
