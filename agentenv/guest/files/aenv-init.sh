#!/.aenv/bin/busybox sh
# agentenv guest init, run by catatonit (PID 1) from the read-only tools drive mounted at /.aenv.
# It prepares the kernel filesystems, modules and network that sandboxes expect, then keeps
# envd running. It only uses busybox from the tools drive, so the root filesystem may be any
# image (no systemd, no shell, no libc needed).
export PATH=/.aenv/busybox
ROOT_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
MODULES="@WORKLOAD_MODULES@"

say() { echo "AENV-INIT: $*" > /dev/console; }
warn() { echo "AENV-INIT-WARNING: $*" > /dev/console; }

is_mounted() { grep -q "^[^ ]* $1 " /proc/mounts; }
mount_once() { # type target options
	mkdir -p "$2" 2>/dev/null
	is_mounted "$2" || mount -t "$1" -o "$3" "$1" "$2" || warn "cannot mount $1 on $2"
}

mount -t proc -o nosuid,nodev,noexec proc /proc 2>/dev/null || is_mounted /proc \
	|| { echo "AENV-INIT-ERROR: cannot mount /proc" > /dev/console; exit 1; }
say "started uptime=$(cut -d' ' -f1 /proc/uptime)"

ip_cidr=""; gateway=""; dns=""; hostname=""; debug_shell=0
for word in $(cat /proc/cmdline); do
	case "$word" in
		aenv.ip=*) ip_cidr=${word#aenv.ip=} ;;
		aenv.gw=*) gateway=${word#aenv.gw=} ;;
		aenv.dns=*) dns=${word#aenv.dns=} ;;
		aenv.hostname=*) hostname=${word#aenv.hostname=} ;;
		aenv.debug_shell=1) debug_shell=1 ;;
	esac
done

mount_once sysfs /sys nosuid,nodev,noexec
mount_once devtmpfs /dev nosuid,mode=0755
mount_once devpts /dev/pts nosuid,noexec,gid=5,mode=0620,ptmxmode=0666
[ -e /dev/ptmx ] || ln -s pts/ptmx /dev/ptmx
mount_once tmpfs /dev/shm nosuid,nodev,mode=1777
mount_once cgroup2 /sys/fs/cgroup nosuid,nodev,noexec,nsdelegate
mount_once tmpfs /run nosuid,nodev,mode=0755
mount_once tmpfs /tmp nosuid,nodev,mode=1777
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
[ -e /dev/stdin ] || ln -s /proc/self/fd/0 /dev/stdin
[ -e /dev/stdout ] || ln -s /proc/self/fd/1 /dev/stdout
[ -e /dev/stderr ] || ln -s /proc/self/fd/2 /dev/stderr

# Kernel modules come from the tools drive so they always match the running kernel.
release=$(uname -r)
if [ -d "/.aenv/lib/modules/$release" ]; then
	mkdir -p "/lib/modules/$release" 2>/dev/null
	is_mounted "/lib/modules/$release" \
		|| mount --bind "/.aenv/lib/modules/$release" "/lib/modules/$release" \
		|| warn "cannot bind the module tree onto /lib/modules/$release"
	# The kernel runs this for on-demand loads (iptables, mount -t overlay, ...).
	[ -x /sbin/modprobe ] || echo /.aenv/busybox/modprobe > /proc/sys/kernel/modprobe
	for module in $MODULES; do
		modprobe "$module" 2>/dev/null || warn "cannot load module $module"
	done
	say "modules loaded: $(cut -d' ' -f1 /proc/modules | tr '\n' ' ')"
else
	warn "no module tree for kernel $release on the tools drive"
fi

# Identity.
if [ -z "$hostname" ] && [ -s /etc/hostname ]; then read -r hostname < /etc/hostname; fi
hostname "${hostname:-sandbox}"
if [ ! -s /etc/machine-id ]; then
	tr -d '-' < /proc/sys/kernel/random/uuid > /etc/machine-id 2>/dev/null \
		|| warn "cannot write /etc/machine-id"
fi

# Network: every sandbox has the same fixed address; the host side differs per namespace.
ip link set lo up
if [ -n "$ip_cidr" ]; then
	tries=0
	while [ ! -e /sys/class/net/eth0 ] && [ "$tries" -lt 200 ]; do
		tries=$((tries + 1)); sleep 0.01
	done
	if ip addr add "$ip_cidr" dev eth0 && ip link set eth0 up; then
		[ -n "$gateway" ] && { ip route add default via "$gateway" dev eth0 \
			|| warn "cannot add default route via $gateway"; }
		say "eth0 $ip_cidr gw ${gateway:-none}"
	else
		warn "cannot configure eth0 with $ip_cidr"
	fi
else
	warn "no aenv.ip= on the kernel command line; eth0 left down"
fi
if [ ! -e /etc/resolv.conf ] && [ ! -L /etc/resolv.conf ]; then
	echo "nameserver ${dns:-8.8.8.8}" > /etc/resolv.conf 2>/dev/null \
		|| warn "cannot write /etc/resolv.conf"
fi

if [ "$debug_shell" = 1 ]; then
	say "debug shell on the console"
	(export PATH="$ROOT_PATH:/.aenv/busybox" HOME=/root TERM=vt100; cd /; setsid cttyhack sh -l) &
fi

# Idle guests must not wake: every wakeup runs guest code on the node's CPU (slowly, under
# TCG). Proactive compaction (for transparent huge pages) woke kcompactd twice a second.
echo 0 > /proc/sys/vm/compaction_proactiveness 2>/dev/null

mkdir -p /var/log 2>/dev/null
say "ready uptime=$(cut -d' ' -f1 /proc/uptime)"
while true; do
	say "starting envd uptime=$(cut -d' ' -f1 /proc/uptime)"
	{
		env -i PATH="$ROOT_PATH" HOME=/root LANG=C.UTF-8 /.aenv/bin/envd 2>&1
		echo "AENV-INIT: envd exited with status $?"
	} | tee -a /var/log/envd.log > /dev/console
	sleep 1
done
