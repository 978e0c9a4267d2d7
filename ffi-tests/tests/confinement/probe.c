/*
 * Native attacks for the confinement suite (ffi-tests/tests/confinement.rs).
 *
 * Built by the test with gcc into a host directory that the supervisor
 * exposes read-only (`Confinement.read_only`), so that R code can
 * dyn.load() it: this is the "noexec removed" case, where R code runs
 * arbitrary native code and only the kernel layers (namespaces, uid,
 * Landlock, seccomp, rlimits) stand between it and the host.
 *
 * Every entry point uses the .C convention (pointers only, no return
 * value). Each probe is bounded: nothing loops or waits without a cap.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

/* errno of a failed call, 0 when it succeeded. */
static int err_of(long rc) { return rc < 0 ? errno : 0; }

static char *sh_argv[] = {"/bin/sh", "-c", "id", NULL};
static char *id_argv[] = {"/usr/bin/id", NULL};
static char *no_env[] = {NULL};

/* A child that does nothing until it is killed (bounded by the caller). */
static pid_t idle_child(void) {
    pid_t c = fork();
    if (c == 0) {
        pause();
        _exit(0);
    }
    return c;
}

static void end_child(pid_t c) {
    if (c > 0) {
        kill(c, SIGKILL);
        waitpid(c, NULL, 0);
    }
}

/* A clone/clone3 child that got created anyway ends at once. */
static int after_clone(long rc) {
    if (rc == 0)
        _exit(0);
    if (rc > 0) {
        waitpid((pid_t)rc, NULL, 0);
        return 0;
    }
    return errno;
}

static volatile uint64_t secret_word = 0x5ec2e75ec2e7ULL;

static int probe(const char *name) {
    errno = 0;
    if (!strcmp(name, "execve_sh"))
        return (execve("/bin/sh", sh_argv, no_env), errno);
    if (!strcmp(name, "execveat_sh"))
        return err_of(syscall(SYS_execveat, AT_FDCWD, "/bin/sh", sh_argv, no_env, 0));
    /* With programs allowed (execve let through): a program not on the
     * allow-list, a copy of an allowed one in the scratch space, mapping a
     * program executable (what `ld.so PROGRAM` does), and access(X_OK). */
    if (!strcmp(name, "execve_id"))
        return (execve("/usr/bin/id", id_argv, no_env), errno);
    if (!strcmp(name, "execveat_id"))
        return err_of(syscall(SYS_execveat, AT_FDCWD, "/usr/bin/id", id_argv, no_env, 0));
    if (!strcmp(name, "execve_copy_in_tmp")) {
        int in = open("/bin/sh", O_RDONLY | O_CLOEXEC);
        int out = open("/tmp/rv-copied-sh", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0755);
        if (in < 0 || out < 0)
            return errno;
        char buf[65536];
        ssize_t n;
        while ((n = read(in, buf, sizeof buf)) > 0)
            if (write(out, buf, (size_t)n) != n)
                return errno;
        close(in);
        close(out);
        return (execve("/tmp/rv-copied-sh", sh_argv, no_env), errno);
    }
    if (!strcmp(name, "mmap_exec_program")) {
        int fd = open("/usr/bin/id", O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            return errno;
        void *m = mmap(NULL, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
        int e = m == MAP_FAILED ? errno : 0;
        if (m != MAP_FAILED)
            munmap(m, 4096);
        close(fd);
        return e;
    }
    if (!strcmp(name, "access_x_program"))
        return err_of(access("/usr/bin/id", X_OK));
    if (!strcmp(name, "memfd_secret"))
        return err_of(syscall(SYS_memfd_secret, 0));
    if (!strcmp(name, "fexecve_memfd")) {
        int fd = (int)syscall(SYS_memfd_create, "x", 0);
        if (fd < 0)
            return errno;
        const char script[] = "#!/bin/sh\nid\n";
        if (write(fd, script, sizeof script - 1) < 0) {
            int e = errno;
            close(fd);
            return e;
        }
        fexecve(fd, sh_argv, no_env);
        int e = errno;
        close(fd);
        return e;
    }
    if (!strcmp(name, "ptrace_attach_child")) {
        pid_t c = idle_child();
        if (c < 0)
            return errno;
        long r = ptrace(PTRACE_ATTACH, c, 0, 0);
        int e = err_of(r);
        end_child(c);
        return e;
    }
    if (!strcmp(name, "ptrace_attach_init"))
        return err_of(ptrace(PTRACE_ATTACH, 1, 0, 0));
    if (!strcmp(name, "process_vm_readv_self")) {
        uint64_t got = 0;
        struct iovec local = {&got, sizeof got};
        struct iovec remote = {(void *)&secret_word, sizeof secret_word};
        return err_of(process_vm_readv(getpid(), &local, 1, &remote, 1, 0));
    }
    if (!strcmp(name, "process_vm_writev_self")) {
        uint64_t put = 1;
        struct iovec local = {&put, sizeof put};
        struct iovec remote = {(void *)&secret_word, sizeof secret_word};
        return err_of(process_vm_writev(getpid(), &local, 1, &remote, 1, 0));
    }
    if (!strncmp(name, "socket_", 7)) {
        static const struct { const char *n; int domain, type; } s[] = {
            {"socket_inet_tcp", AF_INET, SOCK_STREAM},
            {"socket_inet_udp", AF_INET, SOCK_DGRAM},
            {"socket_inet_raw", AF_INET, SOCK_RAW},
            {"socket_inet6_tcp", AF_INET6, SOCK_STREAM},
            {"socket_netlink", AF_NETLINK, SOCK_RAW},
            {"socket_packet", AF_PACKET, SOCK_RAW},
            {"socket_vsock", 40 /* AF_VSOCK */, SOCK_STREAM},
        };
        for (size_t i = 0; i < sizeof s / sizeof s[0]; i++) {
            if (!strcmp(name, s[i].n)) {
                int fd = socket(s[i].domain, s[i].type, 0);
                if (fd >= 0) {
                    close(fd);
                    return 0;
                }
                return errno;
            }
        }
        return -1;
    }
    if (!strcmp(name, "socketpair_inet")) {
        int sv[2];
        int r = socketpair(AF_INET, SOCK_STREAM, 0, sv);
        if (r == 0) {
            close(sv[0]);
            close(sv[1]);
        }
        return err_of(r);
    }
    if (!strcmp(name, "mount_tmpfs"))
        return err_of(mount("none", "/tmp", "tmpfs", 0, "size=1m"));
    if (!strcmp(name, "umount_proc"))
        return err_of(umount2("/proc", MNT_DETACH));
    if (!strcmp(name, "unshare_user"))
        return err_of(unshare(CLONE_NEWUSER));
    if (!strcmp(name, "unshare_net"))
        return err_of(unshare(CLONE_NEWNET));
    if (!strcmp(name, "unshare_mount"))
        return err_of(unshare(CLONE_NEWNS));
    if (!strcmp(name, "clone_newuser"))
        return after_clone(syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0));
    if (!strcmp(name, "clone_newns"))
        return after_clone(syscall(SYS_clone, CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0));
    if (!strcmp(name, "clone3_plain")) {
        struct clone_args a;
        memset(&a, 0, sizeof a);
        a.exit_signal = SIGCHLD;
        return after_clone(syscall(SYS_clone3, &a, sizeof a));
    }
    if (!strcmp(name, "setns_self"))
        return err_of(setns(0, 0));
    if (!strcmp(name, "chroot_tmp"))
        return err_of(chroot("/tmp"));
    if (!strcmp(name, "pivot_root"))
        return err_of(syscall(SYS_pivot_root, "/tmp", "/tmp"));
    if (!strcmp(name, "bpf"))
        return err_of(syscall(SYS_bpf, 0, NULL, 0));
    if (!strcmp(name, "keyctl"))
        return err_of(syscall(SYS_keyctl, 0 /* GET_KEYRING_ID */, -3 /* session */, 0));
    if (!strcmp(name, "io_uring_setup")) {
        char params[120];
        memset(params, 0, sizeof params);
        long fd = syscall(SYS_io_uring_setup, 1, params);
        if (fd >= 0)
            close((int)fd);
        return err_of(fd);
    }
    if (!strcmp(name, "perf_event_open")) {
        char attr[128];
        memset(attr, 0, sizeof attr);
        long fd = syscall(SYS_perf_event_open, attr, 0, -1, -1, 0);
        if (fd >= 0)
            close((int)fd);
        return err_of(fd);
    }
    if (!strcmp(name, "userfaultfd")) {
        long fd = syscall(SYS_userfaultfd, 0);
        if (fd >= 0)
            close((int)fd);
        return err_of(fd);
    }
    /* Invalid magic: even where allowed, the kernel would only say EINVAL. */
    if (!strcmp(name, "reboot_bad_magic"))
        return err_of(syscall(SYS_reboot, 0, 0, 0, NULL));
    if (!strcmp(name, "init_module_null"))
        return err_of(syscall(SYS_init_module, NULL, 0, ""));
    if (!strcmp(name, "setuid_root"))
        return err_of(setuid(0));
    if (!strcmp(name, "setgid_root"))
        return err_of(setgid(0));
    if (!strcmp(name, "mknod_block_device"))
        return err_of(mknod("/tmp/rvisor-sda", S_IFBLK | 0600, makedev(8, 0)));
    if (!strcmp(name, "raise_nproc_limit")) {
        struct rlimit rl;
        getrlimit(RLIMIT_NPROC, &rl);
        rl.rlim_cur = rl.rlim_max = RLIM_INFINITY;
        return err_of(setrlimit(RLIMIT_NPROC, &rl));
    }
    if (!strcmp(name, "raise_as_limit")) {
        struct rlimit rl;
        getrlimit(RLIMIT_AS, &rl);
        rl.rlim_cur = rl.rlim_max = RLIM_INFINITY;
        return err_of(setrlimit(RLIMIT_AS, &rl));
    }
    if (!strcmp(name, "sethostname"))
        return err_of(sethostname("pwned", 5));
    if (!strcmp(name, "open_shadow")) {
        int fd = open("/etc/shadow", O_RDONLY);
        if (fd >= 0) {
            close(fd);
            return 0;
        }
        return errno;
    }
    if (!strcmp(name, "exec_mmap_tmp")) {
        /* Executable memory from a file on the scratch tmpfs (noexec). */
        int fd = open("/tmp/rvisor-code", O_RDWR | O_CREAT | O_TRUNC, 0700);
        if (fd < 0)
            return errno;
        int e = 0;
        if (ftruncate(fd, 4096) != 0) {
            e = errno;
        } else {
            void *p = mmap(NULL, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
            if (p == MAP_FAILED)
                e = errno;
            else
                munmap(p, 4096);
        }
        close(fd);
        unlink("/tmp/rvisor-code");
        return e;
    }
    return -1; /* unknown probe */
}

/* .C("rv_probe", "name", err = integer(1)): errno of the attempt (0: it
 * succeeded, -1: unknown probe name). */
void rv_probe(char **name, int *err) { *err = probe(name[0]); }

/* .C("rv_connect_abstract", "name", err = integer(1)): connect to the
 * abstract Unix socket "\0name". */
void rv_connect_abstract(char **name, int *err) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) {
        *err = errno;
        return;
    }
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    size_t n = strlen(name[0]);
    if (n > sizeof a.sun_path - 2)
        n = sizeof a.sun_path - 2;
    memcpy(a.sun_path + 1, name[0], n);
    int r = connect(fd, (struct sockaddr *)&a, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n));
    *err = err_of(r);
    close(fd);
}

/* .C("rv_kill", pid, sig, err = integer(1)). */
void rv_kill(int *pid, int *sig, int *err) { *err = err_of(kill(*pid, *sig)); }

/* .C("rv_system", status = integer(1)): libc system("id"). */
void rv_system(int *status) { *status = system("id"); }

/* .C("rv_fd_kinds", dirs = integer(1), regular = integer(1), other =
 * integer(1)): the kinds of the open descriptors. An inherited directory
 * descriptor would lead out of the new root (openat(fd, "..")). */
void rv_fd_kinds(int *dirs, int *regular, int *other) {
    *dirs = *regular = *other = 0;
    for (int fd = 0; fd < 4096; fd++) {
        struct stat st;
        if (fstat(fd, &st) != 0)
            continue;
        if (S_ISDIR(st.st_mode))
            (*dirs)++;
        else if (S_ISREG(st.st_mode))
            (*regular)++;
        else
            (*other)++;
    }
}

/* .C("rv_forkbomb", max, forked = integer(1), err = integer(1)): forks idle
 * children until fork fails or `max` were made; the children stay (they end
 * with the worker's pid namespace). */
void rv_forkbomb(int *max, int *forked, int *err) {
    *forked = 0;
    *err = 0;
    for (int i = 0; i < *max; i++) {
        pid_t c = fork();
        if (c < 0) {
            *err = errno;
            return;
        }
        if (c == 0) {
            for (;;)
                pause();
        }
        (*forked)++;
    }
}

/* .C("rv_spin"): burns CPU forever (for the CPU limit). */
void rv_spin(void) {
    volatile uint64_t x = 0;
    for (;;)
        x++;
}
