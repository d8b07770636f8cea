"""The sandbox's launcher: run by the base interpreter (``python -I -S``), it confines one program and reports.

`conveyor.tasks.sandbox` starts this file as a script with one argument, its
settings (a dict, marshalled, in hex), in a new session (its own process group),
with a cleared environment, in a fresh directory, stdout and stderr pointed at
files, and the write end of a status pipe (its number is `status_fd`). It then:

1. with ``isolation == "namespaces"``, enters new mount, network, PID, IPC and
   UTS namespaces (and a user namespace, unless it runs as root), builds a root
   of read-only bind mounts (the system's library folders and the interpreter's
   prefix) plus a size-limited tmpfs at ``/sandbox`` holding the program, and
   chroots into it; the network namespace has no interface up, and the PID
   namespace hides every process outside it;
2. when started as root, drops to an unprivileged user (`uid`, `gid`), so the
   kernel enforces the process limit and the trainer's private files stay closed;
3. forks the program's process (under a supervisor), which sets the rlimits (CPU seconds, address
   space, processes, open files, file size, no core), forbids new privileges,
   clears every capability the namespaces gave, and runs the program as
   ``__main__`` in this interpreter (started once, with ``-I -S``: a second
   start per program would double what a short one costs);
4. the program's parent, a small supervisor (init of the PID namespace), reports
   its wait status and CPU seconds; the launcher waits at most `wall_s`, then
   kills what is left: the namespace's init (the kernel then kills every process
   in the namespace) or, without namespaces, every descendant (it is their
   subreaper, so none escapes by double-forking);
5. writes a marshalled dict to the status pipe: how the program ended.

It imports only the standard library: it runs outside the trainer's environment,
and before its own confinement is complete, so it must stay small enough to read.
"""

import ctypes
import marshal
import os
import resource
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1
SIGKILL = 9  # the signal module is not imported: its enums cost more than a short program
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")

# The interpreter's own symbols include libc's (ctypes.util.find_library would start ldconfig: slower than a run).
_libc = ctypes.CDLL(None, use_errno=True)


def _call(name, *args):
    """A libc call that raises OSError on failure."""
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    if _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target or source}: {os.strerror(err)}")


def _locked_flags(path):
    """The flags a read-only remount of a bind of `path` must keep (a user namespace may not clear them)."""
    f = os.statvfs(path).f_flag
    pairs = (
        (os.ST_NOSUID, MS_NOSUID),
        (os.ST_NODEV, MS_NODEV),
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (getattr(os, "ST_RELATIME", 4096), MS_RELATIME),
    )
    return sum(ms for st, ms in pairs if f & st)


def _bind(host, root, read_only=True):
    """Make `host` visible at the same path under `root` (a symlink stays a symlink)."""
    inside = root + host
    os.makedirs(os.path.dirname(inside), exist_ok=True)
    if os.path.islink(host):
        if not os.path.lexists(inside):
            os.symlink(os.readlink(host), inside)
        return
    if os.path.isdir(host):
        os.makedirs(inside, exist_ok=True)
    else:
        open(inside, "a").close()
    _mount(host, inside, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, inside, None, MS_BIND | MS_REMOUNT | MS_RDONLY | _locked_flags(host))


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _enter_namespaces(cfg):
    """New namespaces and a root of read-only system folders plus /sandbox (a tmpfs with the program)."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        # Root needs no user namespace to mount, and reaches an interpreter under a folder only root may enter;
        # it drops to the sandbox's user after the chroot (see main).
        _call("unshare", flags)
    else:
        _call("unshare", flags | CLONE_NEWUSER)
        # The same unprivileged id inside as outside: never root there, so exec drops every capability.
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    root = cfg["root"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for host in cfg["read_only"]:
        if os.path.lexists(host):
            _bind(host, root)
    for dev in DEVICES:
        if os.path.exists(dev):
            _bind(dev, root, read_only=False)
    box = root + "/sandbox"
    os.makedirs(box)
    _mount("tmpfs", box, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_bytes']},mode=700")
    for name, text in cfg["files"].items():
        _write(os.path.join(box, name), text)
    if uid == 0:
        for name in [".", *cfg["files"]]:
            os.chown(os.path.join(box, name), cfg["uid"], cfg["gid"])
    os.chroot(root)
    os.chdir("/sandbox")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # the scaffold itself is read-only


def _set_limits(cfg):
    lim = cfg["limits"]
    cpu = max(1, int(lim["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["output_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _descendants():
    """Every process below this one, read from /proc (children of children included)."""
    found, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found.extend(kids)
            todo.extend(kids)
    return found


def _kill_all(child, namespaced):
    """Kill the program and everything it started; reap them."""
    if namespaced:
        # Killing a PID namespace's init makes the kernel kill every process in the namespace.
        try:
            os.kill(child, SIGKILL)
        except ProcessLookupError:
            pass
    else:
        for _ in range(100):  # a fork bomb may add processes while they are killed: repeat until none is left
            pids = _descendants()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, SIGKILL)
                except ProcessLookupError:
                    pass
            while True:
                try:
                    if os.waitpid(-1, os.WNOHANG)[0] == 0:
                        break
                except ChildProcessError:
                    break
            time.sleep(0.001)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities():
    """Clear every capability (those a new user namespace gives its creator; a root launcher has none left)."""
    data = (_CapData * 2)()
    _call("capset", ctypes.byref(_CapHeader(0x20080522, 0)), data)  # _LINUX_CAPABILITY_VERSION_3


def _run_program(entry, env):
    """Run `entry` as ``__main__`` in this interpreter (already started: a second start would double the cost of a
    short program) and exit as ``python entry`` would."""
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [entry]
    code = 0
    try:
        with open(entry, "rb") as f:
            code = compile(f.read(), entry, "exec")
        main = type(sys)("__main__")  # a fresh __main__ module, as `python entry` makes (runpy costs an import)
        main.__file__ = entry
        sys.modules["__main__"] = main
        exec(code, main.__dict__)
        code = 0
    except MemoryError:
        # Printing a traceback needs memory the program may still hold: the last line is what the report reads.
        os.write(2, b"MemoryError\n")
        os._exit(1)
    except SystemExit as stop:
        code = stop.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            os.write(2, f"{code}\n".encode(errors="replace"))
            code = 1
    except BaseException:  # noqa: BLE001 - any failure of the program is its exit status 1, as python's own
        import traceback

        try:
            traceback.print_exc()
        except BaseException:  # noqa: BLE001 - stderr past its size limit
            pass
        code = 1
    try:
        sys.stdout.flush()
    except OSError as err:  # output past its size limit: said on stderr, as python's own exit would
        os.write(2, f"OSError: {err}\n".encode())
        code = code or 1
    try:
        sys.stderr.flush()
    except OSError:
        code = code or 1
    os._exit(code & 0xFF)


def _supervise(cfg, report_fd):
    """The program's parent (init of the PID namespace): run it under the limits, report how it ended, exit.

    Init of a PID namespace ignores signals it has no handler for, the kernel's SIGXCPU and SIGXFSZ included, so
    the program never runs as init; its exit also ends every process left in the namespace.
    """
    _libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)  # the launcher gone: nothing may outlive it
    program = os.fork()
    if program == 0:
        try:
            os.close(report_fd)
            _set_limits(cfg)
            _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            _drop_capabilities()
        except BaseException as err:  # noqa: BLE001 - reported as the program's failure, whatever it was
            os.write(2, f"sandbox: cannot start the program: {err}\n".encode())
            os._exit(71)
        _run_program(cfg["entry"], cfg["env"])
    while True:
        try:
            _, wait_status, usage = os.wait4(program, 0)
            break
        except InterruptedError:
            continue
    os.write(report_fd, marshal.dumps((wait_status, usage.ru_utime + usage.ru_stime, usage.ru_maxrss), 4))
    os._exit(0)


def main():
    """Confine and run the program the settings in argv[1] describe (marshal, in hex); report on their `status_fd`."""
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))  # marshal is built in: json's import costs a short program's run
    status = os.fdopen(cfg["status_fd"], "wb")
    try:
        namespaced = cfg["isolation"] == "namespaces"
        if namespaced:
            _enter_namespaces(cfg)
        if os.geteuid() == 0:
            # Every id non-zero: the kernel clears all capabilities, and enforces the process limit.
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        if not namespaced:
            _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except OSError as err:
        status.write(marshal.dumps({"outcome": "sandbox_error", "detail": str(err)}, 4))
        status.close()
        return 70
    report_r, report_w = os.pipe()
    start = time.monotonic()
    supervisor = os.fork()
    if supervisor == 0:
        try:
            status.close()
            os.close(report_r)
            _supervise(cfg, report_w)
        finally:
            os._exit(72)
    os.close(report_w)
    deadline = start + cfg["limits"]["wall_s"]
    timed_out = False
    while os.waitpid(supervisor, os.WNOHANG)[0] != supervisor:
        if time.monotonic() >= deadline:
            timed_out = True
            break
        time.sleep(0.002)
    wall = time.monotonic() - start
    _kill_all(supervisor, namespaced)
    with os.fdopen(report_r, "rb") as f:
        text = f.read()
    report = {"outcome": "timeout" if timed_out else "lost", "exit_code": None, "signal": None, "wall_s": wall}
    if text and not timed_out:
        wait_status, cpu_s, rss = marshal.loads(text)
        report.update(cpu_s=cpu_s, max_rss_kb=rss)
        if os.WIFSIGNALED(wait_status):
            report.update(outcome="signal", signal=os.WTERMSIG(wait_status))
        else:
            report.update(outcome="exited", exit_code=os.WEXITSTATUS(wait_status))
    status.write(marshal.dumps(report, 4))
    status.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
