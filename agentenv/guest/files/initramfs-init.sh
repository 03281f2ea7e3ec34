#!/bin/sh
# agentenv initramfs /init: load the virtio modules, mount the user's root filesystem
# (/dev/vda, read-write) and the read-only tools drive (/dev/vdb) at /.aenv inside it, then
# hand over to catatonit + aenv-init from the tools drive. The user's rootfs is never modified
# beyond creating the empty /.aenv mount point, so any root filesystem works.
export PATH=/bin

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

debug_shell=0
for word in $(cat /proc/cmdline); do
	case "$word" in
		aenv.debug_shell=1) debug_shell=1 ;;
	esac
done

fail() {
	echo "AENV-INITRAMFS-ERROR: $*" > /dev/console
	if [ "$debug_shell" = 1 ]; then
		echo "aenv initramfs: debug shell on the console; 'exit' powers off" > /dev/console
		setsid cttyhack sh
	fi
	# Exiting PID 1 panics the kernel; with panic=-1 reboot=t and QEMU -no-reboot the VMM
	# exits instead of leaving a hung guest.
	exit 1
}

while read -r module; do
	insmod "/modules/$module" || fail "insmod $module failed"
done < /etc/modules

uptime_s() { read -r up _ < /proc/uptime; echo "${up%.*}"; }
wait_for() { # block device, up to 5 s of guest time
	deadline=$(($(uptime_s) + 5))
	while [ ! -b "$1" ]; do
		[ "$(uptime_s)" -ge "$deadline" ] && return 1
		sleep 0.01
	done
}
wait_for /dev/vda || fail "root disk /dev/vda did not appear"
wait_for /dev/vdb || fail "tools disk /dev/vdb did not appear"

# noinit_itable: images are made with lazy inode tables (mke2fs's default), which ext4
# would zero in a kernel thread after the mount; a sandbox restored from a snapshot taken
# meanwhile would redo that, writing to its drive for a minute and waking an idle guest.
# The tables' unused part is never read (the group descriptors count it) and is zero in
# the sparse image anyway.
mount -t ext4 -o rw,noinit_itable /dev/vda /newroot || fail "cannot mount root filesystem /dev/vda"
mkdir -p /newroot/.aenv || fail "cannot create /.aenv on the root filesystem"
mount -t ext4 -o ro /dev/vdb /newroot/.aenv || fail "cannot mount tools drive /dev/vdb"
[ -x /newroot/.aenv/bin/aenv-init ] || fail "tools drive has no bin/aenv-init"

umount /proc
umount /sys
mount --move /dev /newroot/dev 2>/dev/null || {
	mkdir -p /newroot/dev && mount --move /dev /newroot/dev
} || fail "cannot move /dev into the root filesystem"

exec switch_root /newroot /.aenv/bin/catatonit -- /.aenv/bin/aenv-init
