/*
 * agentenv-launch: confine the calling process, then exec a VMM.
 *
 * agentenv/vmm/launch.py builds the command line; scripts/install compiles this file.
 * It does in one process, in this order, what used to take a chain of util-linux tools
 * (unshare, sh, mount, nsenter, setpriv), each exec'ing the next: on a TCG host every
 * exec cost about 2 ms of a resume that takes about 100 ms.
 *
 *   --mount-ns              a private mount namespace, propagation private
 *   --cgroup DIR            join DIR (its cgroup.procs); repeatable, one per hierarchy
 *   --oom-score-adj N       the OOM killer's bias, -1000..1000
 *   --bind SRC DST          bind mounts, made in the order given
 *   --bind-ro SRC DST       (a read-only bind: bind, then remount read-only)
 *   --rbind SRC DST         (a recursive bind: carries the mounts below SRC)
 *   --netns PATH            join the network namespace PATH names (nothing else)
 *   --uid N --gid N         run as N: real, effective and saved ids
 *   --groups A,B,...        supplementary groups (default: none)
 *   --clear-groups          without --uid: stay root, but with no supplementary groups
 *   --no-new-privs          without --uid: set no_new_privs (a program that drops its own
 *                           privileges, like Firecracker's jailer, runs under these two)
 *   --deny-punch-hole       a seccomp filter: fallocate(FALLOC_FL_PUNCH_HOLE) fails with
 *                           EOPNOTSUPP (see deny_punch_hole)
 *   -- ARGV...              what to exec
 *
 * With --uid, the bounding, inheritable and ambient capability sets are emptied and
 * no_new_privs is set before the exec; dropping root then clears what is left. The
 * cgroups are joined before anything is allocated for the VMM, since a later move would
 * not carry memory charged before it. Any failure stops the launch (exit 126, 127 if
 * ARGV cannot be executed) with a message on stderr: a VMM never runs half-confined.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/falloc.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#define NATIVE_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define NATIVE_AUDIT_ARCH AUDIT_ARCH_AARCH64
#else
#error "agentenv-launch knows the seccomp architecture of x86_64 and aarch64 only"
#endif

#define MAX_ITEMS 64
#define MAX_GROUPS 64

enum bind_kind { BIND, BIND_RO, RBIND };

struct bind {
    enum bind_kind kind;
    const char *source;
    const char *target;
};

struct options {
    int mount_ns;
    const char *cgroups[MAX_ITEMS];
    int n_cgroups;
    int has_oom;
    long oom_score_adj;
    struct bind binds[MAX_ITEMS];
    int n_binds;
    const char *netns;
    int has_uid, has_gid;
    uid_t uid;
    gid_t gid;
    gid_t groups[MAX_GROUPS];
    int n_groups;
    int clear_groups, no_new_privs, deny_punch_hole;
    char **argv;
};

static void usage(const char *why, const char *arg) {
    fprintf(stderr, "agentenv-launch: %s%s%s\n", why, arg ? ": " : "", arg ? arg : "");
    exit(2);
}

static void fail(const char *step, const char *arg) {
    int saved = errno;
    fprintf(stderr, "agentenv-launch: %s %s: %s\n", step, arg ? arg : "", strerror(saved));
    exit(126);
}

static long parse_number(const char *text, long lo, long hi) {
    char *end;
    errno = 0;
    long value = strtol(text, &end, 10);
    if (errno || end == text || *end || value < lo || value > hi)
        usage("not a number in range", text);
    return value;
}

static void parse_groups(struct options *o, const char *list) {
    char *copy = strdup(list);
    if (!copy)
        fail("strdup", list);
    for (char *save = NULL, *item = strtok_r(copy, ",", &save); item;
         item = strtok_r(NULL, ",", &save)) {
        if (o->n_groups == MAX_GROUPS)
            usage("too many groups", list);
        o->groups[o->n_groups++] = (gid_t)parse_number(item, 0, INT_MAX);
    }
    free(copy);
}

static void parse(struct options *o, int argc, char **argv) {
    int i = 1;
    for (; i < argc; i++) {
        const char *opt = argv[i];
        int left = argc - i - 1;
        if (!strcmp(opt, "--")) {
            i++;
            break;
        } else if (!strcmp(opt, "--mount-ns")) {
            o->mount_ns = 1;
        } else if (!strcmp(opt, "--cgroup") && left >= 1) {
            if (o->n_cgroups == MAX_ITEMS)
                usage("too many cgroups", NULL);
            o->cgroups[o->n_cgroups++] = argv[++i];
        } else if (!strcmp(opt, "--oom-score-adj") && left >= 1) {
            o->has_oom = 1;
            o->oom_score_adj = parse_number(argv[++i], -1000, 1000);
        } else if ((!strcmp(opt, "--bind") || !strcmp(opt, "--bind-ro") ||
                    !strcmp(opt, "--rbind")) && left >= 2) {
            if (o->n_binds == MAX_ITEMS)
                usage("too many bind mounts", NULL);
            struct bind *b = &o->binds[o->n_binds++];
            b->kind = !strcmp(opt, "--bind") ? BIND : !strcmp(opt, "--bind-ro") ? BIND_RO : RBIND;
            b->source = argv[++i];
            b->target = argv[++i];
        } else if (!strcmp(opt, "--netns") && left >= 1) {
            o->netns = argv[++i];
        } else if (!strcmp(opt, "--uid") && left >= 1) {
            o->has_uid = 1;
            o->uid = (uid_t)parse_number(argv[++i], 0, INT_MAX);
        } else if (!strcmp(opt, "--gid") && left >= 1) {
            o->has_gid = 1;
            o->gid = (gid_t)parse_number(argv[++i], 0, INT_MAX);
        } else if (!strcmp(opt, "--clear-groups")) {
            o->clear_groups = 1;
        } else if (!strcmp(opt, "--no-new-privs")) {
            o->no_new_privs = 1;
        } else if (!strcmp(opt, "--deny-punch-hole")) {
            o->deny_punch_hole = 1;
        } else if (!strcmp(opt, "--groups") && left >= 1) {
            parse_groups(o, argv[++i]);
        } else {
            usage("unknown option or missing argument", opt);
        }
    }
    if (i >= argc)
        usage("no command to run", NULL);
    if (o->has_uid != o->has_gid)
        usage("--uid and --gid go together", NULL);
    if (o->n_binds && !o->mount_ns)
        usage("bind mounts need --mount-ns", NULL);
    o->argv = &argv[i];
}

static void write_text(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        fail("open", path);
    size_t length = strlen(text);
    if (write(fd, text, length) != (ssize_t)length)
        fail("write", path);
    if (close(fd))
        fail("close", path);
}

static void join_cgroup(const char *directory) {
    char path[PATH_MAX], pid[32];
    if (snprintf(path, sizeof path, "%s/cgroup.procs", directory) >= (int)sizeof path)
        usage("cgroup path too long", directory);
    snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    write_text(path, pid);
}

static void make_bind(const struct bind *b) {
    unsigned long flags = MS_BIND | (b->kind == RBIND ? MS_REC : 0);
    if (mount(b->source, b->target, NULL, flags, NULL))
        fail("bind mount", b->target);
    if (b->kind == BIND_RO &&
        mount(NULL, b->target, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL))
        fail("remount read-only", b->target);
}

static int last_capability(void) {
    int fd = open("/proc/sys/kernel/cap_last_cap", O_RDONLY | O_CLOEXEC);
    char text[16] = {0};
    if (fd < 0 || read(fd, text, sizeof text - 1) <= 0)
        fail("read", "/proc/sys/kernel/cap_last_cap");
    close(fd);
    return (int)parse_number(strtok(text, "\n"), 0, 255);
}

static void drop_privileges(const struct options *o) {
    if (setgroups((size_t)o->n_groups, o->groups))
        fail("setgroups", NULL);
    if (setresgid(o->gid, o->gid, o->gid))
        fail("setresgid", NULL);
    for (int cap = last_capability(); cap >= 0; cap--)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0))
            fail("drop from the bounding set", NULL);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0))
        fail("clear the ambient set", NULL);
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3];
    if (syscall(SYS_capget, &header, data))
        fail("capget", NULL);
    for (int i = 0; i < _LINUX_CAPABILITY_U32S_3; i++)
        data[i].inheritable = 0;
    if (syscall(SYS_capset, &header, data))
        fail("clear the inheritable set", NULL);
    // Leaving uid 0 empties the permitted and effective sets (no SECBIT_KEEP_CAPS).
    if (setresuid(o->uid, o->uid, o->uid))
        fail("setresuid", NULL);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
        fail("set no_new_privs", NULL);
}

/*
 * QEMU 7.2 gives a page the guest's balloon driver hands back to the host by punching it
 * out of the file that backs guest RAM, even when it maps that file privately: the
 * template or fork image other sandboxes map too. A guest could zero pages of its
 * siblings' memory that way. Denying the punch leaves QEMU to log the failure and keep
 * the page (8.2 fixed the discard for private mappings). The VMM's disks lose hole
 * punching with it: blocks the guest discards stay allocated, and zeroes it writes are
 * written. Only the native calling convention is matched: the threat is QEMU's own
 * balloon code on behalf of a guest, not a compromised VMM (which holds the file open
 * read-write in any case; QEMU 8.2's readonly=on,rom=off would close that).
 */
static void deny_punch_hole(void) {
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NATIVE_AUDIT_ARCH, 0, 5),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_fallocate, 0, 3),
        // The mode (an int): the low word of the second argument, on little-endian hosts.
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[1])),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, FALLOC_FL_PUNCH_HOLE, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EOPNOTSUPP & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog program = {sizeof filter / sizeof filter[0], filter};
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &program))
        fail("install the seccomp filter", "--deny-punch-hole");
}

int main(int argc, char **argv) {
    static struct options o;
    parse(&o, argc, argv);
    if (o.mount_ns) {
        if (unshare(CLONE_NEWNS))
            fail("unshare", "mount namespace");
        // Mounts made here never reach the host, and later host mounts do not come in.
        if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL))
            fail("make mounts private", "/");
    }
    for (int i = 0; i < o.n_cgroups; i++)
        join_cgroup(o.cgroups[i]);
    if (o.has_oom) {
        char text[16];
        snprintf(text, sizeof text, "%ld\n", o.oom_score_adj);
        write_text("/proc/self/oom_score_adj", text);
    }
    for (int i = 0; i < o.n_binds; i++)
        make_bind(&o.binds[i]);
    if (o.netns) {
        int fd = open(o.netns, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            fail("open", o.netns);
        if (setns(fd, CLONE_NEWNET))
            fail("setns", o.netns);
        close(fd);
    }
    if (o.has_uid) {
        drop_privileges(&o);
    } else {
        if (o.clear_groups && setgroups(0, NULL))
            fail("setgroups", NULL);
        if (o.no_new_privs && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
            fail("set no_new_privs", NULL);
    }
    // Last: no_new_privs (or root) lets it be installed, and nothing above is filtered.
    if (o.deny_punch_hole)
        deny_punch_hole();
    execvp(o.argv[0], o.argv);
    int saved = errno;
    fprintf(stderr, "agentenv-launch: exec %s: %s\n", o.argv[0], strerror(saved));
    return 127;
}
