"""Running model-written code where it cannot touch the tests, the machine, or the verdict.

runner.py starts the confined child (confine.py) and reads its verdict; `run_tests` is what a reward calls:

    from minigrpo.sandbox import run_tests

The layers, applied in this order, each by the kernel, so nothing the program does in Python undoes them:
  rlimits     cpu seconds, address space, file size, open files, processes; no core dumps
  namespaces  new user, pid, network, ipc, uts and mount namespaces: the program is pid 1 of its own process
              tree (when it ends, the kernel kills everything in it), sees no other process, and has no
              network device at all; it holds no capabilities
  own root    pivot_root into a tmpfs of a fixed size holding only the standard library and shared libraries
              (bound read-only, site-packages hidden), /dev/null, /dev/urandom and its folder /work: no other
              path exists for it, so no stat, inotify or /proc of anything outside
  landlock    the filesystem: read-only access to Python's standard library (not site-packages) and the
              shared libraries it loads, read-write access to its own folder, nothing else (not /proc,
              not /etc, not /home); no TCP bind or connect; no signals to, or abstract sockets of, processes
              outside (each where the kernel's Landlock ABI has it)
  seccomp     system calls refused with EPERM: new processes (fork, vfork, clone without CLONE_THREAD),
              exec, sockets, setsid/setpgid (leaving the process group the parent kills), ptrace and
              process_vm_*, mount and namespace calls, io_uring, bpf, perf, keyrings, modules, file handles,
              and what Landlock leaves open: chmod, chown, utime and extended attributes
  audit hook  a second layer inside the interpreter, for readable errors; the kernel layers are the boundary
Where the kernel lacks a layer, the job's `require` decides: a required layer missing means the program is
not run at all.
"""

from minigrpo.sandbox.runner import SandboxError, Verdict, layers, run_tests

__all__ = ["SandboxError", "Verdict", "layers", "run_tests"]
