"""A seccomp filter for candidates: no namespaces or tracing, nothing that outlives a sample.

Inside bubblewrap a candidate could otherwise create a user namespace
(unprivileged user namespaces are on in most kernels), gain capabilities in
it and mount a tmpfs that no size cap or rlimit accounts for, or escape the
process bookkeeping with a new PID namespace. The filter refuses (EPERM)
`unshare`, `setns`, every mount-API call, `chroot`, `clone` with any
CLONE_NEW* flag, tracing (`ptrace`, `process_vm_*`), keyrings, `bpf`,
`perf_event_open`, `userfaultfd`, io_uring and module/kexec/swap/reboot
calls; `clone3` answers ENOSYS so the C library falls back to `clone`, whose
flags the filter can read.

It also refuses what would let a sample leave state for the next one (the
server's health check then finds none; see `server`):
  * System V IPC (`shmget`, `semget`, `msgget` and the calls on their
    objects) and POSIX message queues (`mq_*`): those objects belong to the
    IPC namespace, not to a process, so one made by a sample would outlive
    it (holding memory, or carrying data to the next sample);
  * setting or removing extended attributes (`setxattr`, `removexattr` and
    their l-, f- and -at forms): user attributes and POSIX ACLs (a default
    ACL on a directory sets the mode of every file later made in it);
    reading them stays allowed;
  * setting file times (`utime`, `utimes`, `futimesat`, `utimensat`): any
    process may set a world-writable file's times to now, and /dev/null and
    its kind are the host's own nodes, shared by every sample on the host
    (so `shutil.copy2` and `copystat` fail in the sandbox; `shutil.copy`
    works);
  * `sendmsg` and `sendmmsg`: descriptors in flight in a unix socket's queue
    (SCM_RIGHTS) outlive the processes that sent them until the kernel's
    garbage collector runs, so a lock or an abstract socket name held that
    way could reach the next sample (plain `send`/`write` stay allowed);
  * sockets of any family but AF_UNIX (EAFNOSUPPORT): there is no network in
    the sandbox, and a TCP connection's TIME_WAIT outlives its process;
  * changing another process's limits, priority, scheduling or memory
    placement (`prlimit64`, `setpriority`, `sched_set*`, `ioprio_set`,
    `migrate_pages`, `move_pages` with a pid or target other than 0, the
    caller itself, even its own pid spelled out): where candidates share the
    server's uid the next candidate's process (a spare, forked ahead) would
    keep them.
Other architectures and x32 calls on x86-64 are killed. It is installed with
no_new_privs, after the process has its final identity. Standard library
only (ctypes): runs inside the sandbox.
"""

import ctypes
import errno
import functools
import os
import struct

_AUDIT_ARCH = {'x86_64': 0xC000003E, 'aarch64': 0xC00000B7}
# name -> number, per architecture.
_SYSCALLS = {
    'x86_64': dict(
        clone=56, clone3=435, unshare=272, setns=308, mount=165, umount2=166, pivot_root=155,
        chroot=161, ptrace=101, process_vm_readv=310, process_vm_writev=311, keyctl=250,
        add_key=248, request_key=249, bpf=321, perf_event_open=298, userfaultfd=323,
        io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_tree=428,
        move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
        kexec_load=246, kexec_file_load=320, init_module=175, finit_module=313,
        delete_module=176, swapon=167, swapoff=168, reboot=169, acct=163,
        name_to_handle_at=303, open_by_handle_at=304,
        shmget=29, shmat=30, shmctl=31, shmdt=67, semget=64, semop=65, semctl=66,
        semtimedop=220, msgget=68, msgsnd=69, msgrcv=70, msgctl=71, mq_open=240,
        mq_unlink=241, mq_timedsend=242, mq_timedreceive=243, mq_notify=244,
        mq_getsetattr=245,
        setxattr=188, lsetxattr=189, fsetxattr=190, removexattr=197, lremovexattr=198,
        fremovexattr=199, setxattrat=463, removexattrat=466,
        utime=132, utimes=235, futimesat=261, utimensat=280, sendmsg=46, sendmmsg=307,
        socket=41, prlimit64=302, setpriority=141, sched_setaffinity=203, sched_setparam=142,
        sched_setscheduler=144, sched_setattr=314, ioprio_set=251, migrate_pages=256,
        move_pages=279),
    'aarch64': dict(
        clone=220, clone3=435, unshare=97, setns=268, mount=40, umount2=39, pivot_root=41,
        chroot=51, ptrace=117, process_vm_readv=270, process_vm_writev=271, keyctl=219,
        add_key=217, request_key=218, bpf=280, perf_event_open=241, userfaultfd=282,
        io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_tree=428,
        move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
        kexec_load=104, kexec_file_load=294, init_module=105, finit_module=273,
        delete_module=106, swapon=224, swapoff=225, reboot=142, acct=89,
        name_to_handle_at=264, open_by_handle_at=265,
        # The *_time64 IPC calls (418-420) exist only for 32-bit ABIs.
        shmget=194, shmat=196, shmctl=195, shmdt=197, semget=190, semop=193, semctl=191,
        semtimedop=192, msgget=186, msgsnd=189, msgrcv=188, msgctl=187, mq_open=180,
        mq_unlink=181, mq_timedsend=182, mq_timedreceive=183, mq_notify=184,
        mq_getsetattr=185,
        setxattr=5, lsetxattr=6, fsetxattr=7, removexattr=14, lremovexattr=15,
        fremovexattr=16, setxattrat=463, removexattrat=466,
        # No utime, utimes or futimesat here: utimensat is the only one.
        utimensat=88, sendmsg=211, sendmmsg=269,
        socket=198, prlimit64=261, setpriority=140, sched_setaffinity=122, sched_setparam=118,
        sched_setscheduler=119, sched_setattr=274, ioprio_set=30, migrate_pages=238,
        move_pages=239),
}
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME.
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 \
    | 0x40000000 | 0x00000080

AF_UNIX = 1
# Calls allowed only with these arguments (index, value of its low 32 bits: every one is an
# int or a pid, which the kernel reads from the low half), else refused with the errno:
# only on the caller itself (pid 0; setpriority and ioprio_set: 'which' is the process,
# 'who' is 0), and only unix-domain sockets.
_ONLY = {
    'socket': (((0, AF_UNIX),), errno.EAFNOSUPPORT),
    'prlimit64': (((0, 0),), errno.EPERM),
    'setpriority': (((0, 0), (1, 0)), errno.EPERM),  # PRIO_PROCESS, who 0.
    'ioprio_set': (((0, 1), (1, 0)), errno.EPERM),  # IOPRIO_WHO_PROCESS, who 0.
    'sched_setaffinity': (((0, 0),), errno.EPERM),
    'sched_setparam': (((0, 0),), errno.EPERM),
    'sched_setscheduler': (((0, 0),), errno.EPERM),
    'sched_setattr': (((0, 0),), errno.EPERM),
    'migrate_pages': (((0, 0),), errno.EPERM),
    'move_pages': (((0, 0),), errno.EPERM),
}

_LD_W_ABS, _JEQ, _JSET, _JGE, _RET = 0x20, 0x15, 0x45, 0x35, 0x06
_ALLOW, _KILL_PROCESS = 0x7FFF0000, 0x80000000
_ERRNO = 0x00050000
_OFF_NR, _OFF_ARCH = 0, 4  # struct seccomp_data
_OFF_ARGS = 16  # args[i]'s low word (little endian) is at 16 + 8 * i.


def supported() -> str:
  """'' if this machine's architecture has a filter, else why not."""
  machine = os.uname().machine
  if machine not in _SYSCALLS or struct.pack('=I', 1)[0] != 1:
    return f'no seccomp filter for architecture {machine!r}'
  return ''


def program(machine: str) -> list[tuple[int, int, int, int]]:
  """The classic-BPF filter as (code, jt, jf, k) instructions."""
  nrs = _SYSCALLS[machine]
  denied = sorted(v for k, v in nrs.items() if k not in ('clone', 'clone3') and k not in _ONLY)
  prog = [(_LD_W_ABS, 0, 0, _OFF_ARCH),
          (_JEQ, 1, 0, _AUDIT_ARCH[machine]),
          (_RET, 0, 0, _KILL_PROCESS),
          (_LD_W_ABS, 0, 0, _OFF_NR)]
  if machine == 'x86_64':  # x32 system calls (nr | 0x40000000).
    prog += [(_JGE, 0, 1, 0x40000000), (_RET, 0, 0, _KILL_PROCESS)]
  for nr in denied:
    prog += [(_JEQ, 0, 1, nr), (_RET, 0, 0, _ERRNO | errno.EPERM)]
  prog += [(_JEQ, 0, 1, nrs['clone3']), (_RET, 0, 0, _ERRNO | errno.ENOSYS)]
  for name, (args, err) in sorted(_ONLY.items()):
    # A matching call loads its arguments and always returns; any other keeps the number in A.
    n = len(args)
    prog.append((_JEQ, 0, 2 * n + 2, nrs[name]))
    for j, (index, value) in enumerate(args):
      prog += [(_LD_W_ABS, 0, 0, _OFF_ARGS + 8 * index),
               (_JEQ, 0, 2 * (n - j) - 1, value)]
    prog += [(_RET, 0, 0, _ALLOW), (_RET, 0, 0, _ERRNO | err)]
  prog += [(_JEQ, 0, 3, nrs['clone']),
           (_LD_W_ABS, 0, 0, _OFF_ARGS),
           (_JSET, 0, 1, CLONE_NEW_ANY),
           (_RET, 0, 0, _ERRNO | errno.EPERM),
           (_RET, 0, 0, _ALLOW)]
  return prog


class _SockFprog(ctypes.Structure):
  _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_void_p)]


@functools.lru_cache(maxsize=None)
def _prepared():
  """The filter as the kernel takes it and the C library, built once per process: a server
  calls `prepare` before it forks, so each child installs without building either again."""
  prog = program(os.uname().machine)
  raw = b''.join(struct.pack('=HBBI', *ins) for ins in prog)
  buf = ctypes.create_string_buffer(raw, len(raw))
  fprog = _SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
  return fprog, buf, ctypes.CDLL(None, use_errno=True)


def prepare() -> None:
  """Builds the filter now (in a parent that forks the processes that `install` it)."""
  if not supported():
    _prepared()


def install() -> None:
  """Installs the filter on the calling thread's process (irreversible).

  Raises:
    OSError: the kernel refused it, or the architecture is unsupported.
  """
  why = supported()
  if why:
    raise OSError(errno.ENOSYS, why)
  fprog, _, libc = _prepared()
  if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
    raise OSError(ctypes.get_errno(), 'prctl(PR_SET_NO_NEW_PRIVS) failed')
  if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, MODE_FILTER
    raise OSError(ctypes.get_errno(), 'prctl(PR_SET_SECCOMP) failed')
