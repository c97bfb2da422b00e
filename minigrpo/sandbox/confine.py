"""The sandbox's child: confine this process with the kernel, then run one program on the tests' arguments.

Run as `python -I -S confine.py` with a job (JSON) on stdin; it writes to the job's file descriptor one line
reporting the layers it got, then (unless a required layer is missing) the program's results. Standard library
only: the child never sees site-packages, where the tests may live; its one other file is syscalls.json.

The layers it applies, and what each refuses, are listed in the package's docstring (sandbox/__init__.py).
"""

import ctypes
import json
import os
import resource
import signal
import struct
import sys

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_THREAD = 0x00010000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2


def limit_resources(memory_mb: int, cpu_seconds: int) -> None:
    limits = {resource.RLIMIT_CPU: cpu_seconds, resource.RLIMIT_AS: memory_mb << 20,
              resource.RLIMIT_FSIZE: 1 << 20, resource.RLIMIT_NOFILE: 64, resource.RLIMIT_CORE: 0}
    for kind, value in limits.items():
        resource.setrlimit(kind, (value, value))
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    # threads count as processes; 64 more than the user runs now (an absolute 64 would refuse a busy user)
    resource.setrlimit(resource.RLIMIT_NPROC, (min(hard, 64 + _processes_of_this_user()),) * 2)


def _processes_of_this_user() -> int:
    uid, count = os.getuid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                count += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                pass
    return count


def enter_namespaces() -> str:
    """New user + pid + net + ipc + uts namespaces; the returned names say which. Needs a fork afterwards:
    only children enter the new pid namespace."""
    uid, gid = os.geteuid(), os.getegid()
    rest = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNS
    for flags, names in ((CLONE_NEWUSER | rest, "user+pid+net+ipc+uts"), (rest, "pid+net+ipc+uts")):
        if LIBC.unshare(flags) == 0:
            break
    else:
        return ""
    if flags & CLONE_NEWUSER:  # the same ids inside, mapped to ours outside; no other id exists in there
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                           ("/proc/self/gid_map", f"{gid} {gid} 1")):
            with open(path, "w") as f:
                f.write(text)
    return names


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 1 << 14, 1 << 18
MNT_DETACH = 2


def own_root(size_mb: int, shown: list[str]) -> tuple[str, str]:
    """A root of the program's own: a tmpfs of `size_mb` on the working folder (in this mount namespace only,
    so its files cannot fill the disk and vanish with it) holding `shown` bound read-only at their own paths,
    /dev/null, /dev/urandom and the writable folder /work; then pivot_root into it and detach the old root.
    Paths outside this view do not exist for the program: no stat, no inotify, no /proc. Returns (the
    program's folder, a description); where a step fails, the program keeps the tmpfs folder in the old root."""
    folder = os.getcwd()
    LIBC.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    # nothing mounted here may propagate out (pivot_root also refuses shared mounts)
    if LIBC.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) or LIBC.mount(
            b"tmpfs", folder.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode=700".encode()):
        return folder, ""
    work = os.path.join(folder, "work")
    os.mkdir(work, 0o700)
    try:
        _build_root(folder, shown)
        os.mkdir(os.path.join(folder, ".old"))
        os.chdir(folder)
        if LIBC.syscall(155 if _arch() == "x86_64" else 41, b".", b".old") or LIBC.umount2(b"/.old", MNT_DETACH):
            raise OSError(ctypes.get_errno(), "pivot_root")
        os.rmdir("/.old")
    except OSError:
        os.chdir(work)
        return work, f"tmpfs {size_mb} MiB"
    os.chdir("/work")
    return "/work", f"own root, tmpfs {size_mb} MiB"


def _build_root(root: str, shown: list[str]) -> None:
    """Bind each shown path read-only at the same path under `root`, hide site-packages inside them, and keep
    the top-level links (/lib -> usr/lib) the dynamic loader's paths go through."""
    for name in os.listdir("/"):
        if os.path.islink("/" + name):
            os.symlink(os.readlink("/" + name), os.path.join(root, name))
    covered: list[str] = []
    for path in sorted(set(shown)):
        if any(path.startswith(c + os.sep) for c in covered):
            continue
        target = root + path
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
            covered.append(path)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
        device = path.startswith("/dev/")
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | (0 if device else MS_NODEV)
        if LIBC.mount(path.encode(), target.encode(), None, MS_BIND | MS_REC, None) or \
                (not device and LIBC.mount(None, target.encode(), None, flags, None)):
            raise OSError(ctypes.get_errno(), f"bind {path}")
        for hidden in ("site-packages", "dist-packages"):  # where tests or secrets may live
            inner = os.path.join(target, hidden)
            if os.path.isdir(inner) and LIBC.mount(b"tmpfs", inner.encode(), b"tmpfs", MS_RDONLY, b"size=4k"):
                raise OSError(ctypes.get_errno(), f"hide {inner}")


def drop_capabilities() -> None:
    """No capabilities, even inside the namespace the process owns."""
    header = struct.pack("II", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = ctypes.create_string_buffer(24)  # two zeroed {effective, permitted, inheritable}
    LIBC.syscall(126 if _arch() == "x86_64" else 91, ctypes.c_char_p(header), data)  # capset


# Landlock: https://docs.kernel.org/userspace-api/landlock.html (the syscall numbers are the same on every
# architecture)
LANDLOCK_CREATE, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ALL_V1 = (1 << 13) - 1  # execute .. make_sym
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1


def landlock_abi() -> int:
    return max(0, LIBC.syscall(LANDLOCK_CREATE, None, 0, 1))  # LANDLOCK_CREATE_RULESET_VERSION


def restrict_filesystem(workdir: str, readable: list[str]) -> int:
    """Landlock rules: `readable` (the standard library and shared libraries) read-only, `workdir`
    read-write, nothing else. Returns the ABI version applied (0: none)."""
    abi = landlock_abi()
    if abi < 1:
        return 0
    handled = FS_ALL_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | \
        (FS_IOCTL_DEV if abi >= 5 else 0)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("QQQ", handled, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = LIBC.syscall(LANDLOCK_CREATE, ctypes.c_char_p(attr), len(attr), 0)
    if ruleset < 0:
        return 0
    file_rights = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (FS_TRUNCATE if abi >= 3 else 0)
    read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    try:
        for path in readable:
            _allow(ruleset, path, read if os.path.isdir(path) else read & file_rights)
        for path in ("/dev/null", "/dev/urandom"):
            _allow(ruleset, path, FS_READ_FILE | FS_WRITE_FILE)
        _allow(ruleset, workdir, handled)
        if LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or LIBC.syscall(LANDLOCK_RESTRICT, ruleset, 0):
            return 0
    finally:
        os.close(ruleset)
    return abi


def readable_paths() -> list[str]:
    """Python's standard library entry by entry (so site-packages is left out even where it lives inside),
    and the shared libraries it loads."""
    paths = [p for p in sys.path if os.path.isfile(p)]  # the zipped standard library, if any
    for folder in (p for p in sys.path if os.path.isdir(p)):
        paths += [os.path.join(folder, name) for name in os.listdir(folder)
                  if name not in ("site-packages", "dist-packages")]
    return paths + library_paths()


def shown_paths() -> list[str]:
    """What the program's own root holds, bound read-only: the standard library's folders (their
    site-packages hidden), the shared libraries, and the two devices Python reads."""
    return [p for p in sys.path if os.path.exists(p)] + library_paths() + ["/dev/null", "/dev/urandom"]


def library_paths() -> list[str]:
    """The folders of the shared libraries already loaded (file by file where Python lives there too), and
    the loader's cache."""
    with open("/proc/self/maps") as maps:
        loaded = {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}
    paths = []
    for folder in {os.path.dirname(p) for p in loaded if ".so" in os.path.basename(p)}:
        names = os.listdir(folder)
        if any(name.startswith(("python", "site-packages", "dist-packages")) for name in names):
            paths += [os.path.join(folder, name) for name in names if ".so" in name]
        else:
            paths.append(folder)
    return paths + ["/etc/ld.so.cache"]


def _allow(ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        rule = struct.pack("=Qi", rights, fd)  # landlock_path_beneath_attr, packed
        LIBC.syscall(LANDLOCK_ADD_RULE, ruleset, 1, ctypes.c_char_p(rule), 0)
    finally:
        os.close(fd)


# seccomp: system calls refused with EPERM, by number, from the kernel's tables for x86_64 and aarch64 (elsewhere
# this layer is reported missing); chmod, chown, utime and xattr calls among them, as Landlock leaves a file's
# mode, owner, times and attributes open. Read now: the process's own root will not hold the file.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "syscalls.json")) as tables:
    # architecture: (AUDIT_ARCH_*, clone, clone3, refused); aarch64 has no fork or vfork (clone does both)
    SYSCALLS = {arch: (int(t["audit_arch"], 16), t["clone"], t["clone3"], t["refused"])
                for arch, t in json.load(tables).items()}
RET_KILL, RET_ALLOW = 0x80000000, 0x7FFF0000
RET_EPERM, RET_ENOSYS = 0x00050000 | 1, 0x00050000 | 38
LD_W_ABS, JEQ, JSET, JGE, RET = 0x20, 0x15, 0x45, 0x35, 0x06


def filter_syscalls() -> bool:
    """Install the seccomp filter; False where this architecture has no table here."""
    if _arch() not in SYSCALLS:
        return False
    audit_arch, clone, clone3, refused = SYSCALLS[_arch()]
    denied = sorted(refused.values())
    # [load arch; other arch -> kill; load nr; x32 -> deny; clone3 -> ENOSYS (threads fall back to clone);
    #  clone -> check flags; each denied nr -> deny; allow; flags: CLONE_THREAD -> allow else deny; deny]
    prog = [(LD_W_ABS, 0, 0, 4), (JEQ, 1, 0, audit_arch), (RET, 0, 0, RET_KILL), (LD_W_ABS, 0, 0, 0),
            (JGE, 0, 1, 0x40000000), (RET, 0, 0, RET_EPERM), (JEQ, 0, 1, clone3), (RET, 0, 0, RET_ENOSYS)]
    n = len(denied)
    prog.append((JEQ, n + 1, 0, clone))  # to the flags check, past the list and the allow
    prog += [(JEQ, n - i + 3, 0, nr) for i, nr in enumerate(denied)]  # to the final deny
    prog += [(RET, 0, 0, RET_ALLOW), (LD_W_ABS, 0, 0, 16), (JSET, 0, 1, CLONE_THREAD), (RET, 0, 0, RET_ALLOW),
             (RET, 0, 0, RET_EPERM)]
    code = b"".join(struct.pack("HBBI", *op) for op in prog)
    buffer = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buffer))
    if LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        return False
    return LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0) == 0


def _arch() -> str:
    return os.uname().machine


def guard_interpreter(root: str) -> None:
    """The second layer: readable errors for what the kernel refuses anyway. The program can reach this
    hook's state, so it is no boundary; the kernel layers are."""
    blocked = ("socket.", "subprocess.", "os.fork", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
               "os.kill", "os.killpg", "ctypes.", "pty.")

    def hook(event, args, root=root, blocked=blocked, realpath=os.path.realpath, fsdecode=os.fsdecode, sep=os.sep):
        # everything it uses is bound here: the program can rebind this module's globals
        if event.startswith(blocked):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and isinstance(args[0], (str, bytes)):
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
            path = realpath(fsdecode(args[0]))
            if any(c in mode for c in "wax+") and not (path == root or path.startswith(root + sep)):
                raise PermissionError(f"sandbox: writing {path} is outside the sandbox")

    sys.addaudithook(hook)


def confine(job: dict) -> dict:
    """Apply every layer this kernel has; the names of those applied, by layer."""
    limit_resources(job["memory_mb"], job["cpu_seconds"])
    layers = {"namespaces": enter_namespaces()}
    if "pid" in layers["namespaces"]:
        _become_init_of_new_pid_namespace()
    readable = readable_paths()  # read now: the program's root has no /proc
    workdir, layers["folder"] = own_root(job["disk_mb"], shown_paths()) if layers["namespaces"] else (os.getcwd(), "")
    os.environ.update(HOME=workdir, TMPDIR=workdir)
    layers["landlock"] = restrict_filesystem(workdir, readable)
    drop_capabilities()
    layers["seccomp"] = filter_syscalls()
    return layers


def _become_init_of_new_pid_namespace() -> None:
    """Fork: the child is pid 1 of the new namespace and carries on; this process waits and passes on its
    status. When pid 1 ends, the kernel kills every process left in the namespace."""
    child = os.fork()
    if child == 0:
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the parent killed -> the whole tree goes
        return
    _, status = os.waitpid(child, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def missing(layers: dict, require: list[str]) -> list[str]:
    """The required layers (filesystem, processes, network) this child could not get."""
    have = {"filesystem": bool(layers["landlock"]),
            "processes": "pid" in layers["namespaces"] or layers["seccomp"],
            "network": "net" in layers["namespaces"] or layers["seccomp"]}
    return [name for name in require if not have[name]]


def run(job: dict) -> object:
    namespace = {"__name__": "solution"}
    try:
        exec(compile(job["program"], "solution.py", "exec"), namespace)
        fn = namespace[job["function"]]
    except BaseException as error:
        return {"error": f"{type(error).__name__}: {error}"[:300]}
    outputs = []
    for args in job["inputs"]:
        try:
            outputs.append({"value": fn(*args)})
        except BaseException as error:
            outputs.append({"error": type(error).__name__})
    return outputs


def main() -> None:
    job = json.loads(sys.stdin.read())
    results = os.fdopen(int(job["fd"]), "w")
    os.close(0)
    layers = confine(job)
    lacking = missing(layers, job["require"])
    # the first line is the layers report, written before the program runs: whatever the program writes
    # to this pipe comes after it, so it can never pass for the report
    results.write(json.dumps({"layers": layers, "missing": lacking}) + "\n")
    results.flush()
    if job.get("probe") or lacking:
        results.close()
        os._exit(0)
    if job.get("guard", True):
        guard_interpreter(os.path.realpath(os.getcwd()))
    dumps, leave = json.dumps, os._exit  # the program may rebind this module's globals
    outputs = run(job)
    results.write(dumps(outputs, default=repr))
    results.close()
    leave(0)


if __name__ == "__main__":
    main()
