"""Single-copy transfers between the processes of one node (Linux cross-memory attach).

``process_vm_readv`` and ``process_vm_writev`` copy bytes between this
process's memory and another process's private memory in one pass: the
kernel pins the peer's pages and copies, so data reaches a peer without
first being staged in shared memory (Open MPI's ``smsc/cma`` component does
the same).  The kernel allows it between processes of one user that may
ptrace each other: Yama's ``ptrace_scope`` >= 1 or a container's seccomp
filter can forbid it, and hpctrain never relaxes either.  The caller
(:class:`hpctrain.comm.backends.mpi.MPIBackend`) probes once, collectively, and
falls back to the shared-memory arena on every rank when any rank cannot.

Cost: one system call per batch of up to ``IOV_MAX`` spans, plus one memory
read and one write of the bytes moved.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Sequence, Tuple

import numpy as np

__all__ = ["CrossMemory"]

_IOV_MAX = 1024   # the most spans one call takes (Linux UIO_MAXIOV)


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


Span = Tuple[int, int]   # (address in the peer, bytes)


class CrossMemory:
    """Copy between this process's arrays and spans of a peer process's memory (see module docstring).

    Raises OSError when made on a system without the calls (not Linux, or a
    C library without them); a call that the kernel refuses raises OSError
    naming the peer and the reason.
    """

    def __init__(self):
        if not sys.platform.startswith("linux"):
            raise OSError("cross-memory attach (process_vm_readv) needs Linux")
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            calls = libc.process_vm_readv, libc.process_vm_writev
        except AttributeError as exc:
            raise OSError(f"the C library has no process_vm_readv/writev: {exc}") from None
        for f in calls:
            f.restype = ctypes.c_ssize_t
            f.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec),
                          ctypes.c_ulong, ctypes.c_ulong]
        self._readv, self._writev = calls
        self._local = _IOVec()
        self._remote = (_IOVec * _IOV_MAX)()

    def read(self, pid: int, spans: Sequence[Span], dest: np.ndarray) -> None:
        """Copy the peer's bytes at ``spans``, laid end to end, into the C-contiguous array ``dest``."""
        self._move(self._readv, "read from", pid, spans, dest)

    def write(self, pid: int, spans: Sequence[Span], src: np.ndarray) -> None:
        """Copy the C-contiguous array ``src`` into the peer's memory at ``spans``, laid end to end."""
        self._move(self._writev, "write to", pid, spans, src)

    def _move(self, call, what: str, pid: int, spans: Sequence[Span], arr: np.ndarray) -> None:
        total = sum(n for _, n in spans)
        if total != arr.nbytes or not arr.flags.c_contiguous:
            raise ValueError(f"cannot {what} process {pid}: {total} bytes of spans for a "
                             f"{'' if arr.flags.c_contiguous else 'non-contiguous '}array of {arr.nbytes} bytes")
        local, remote, here = self._local, self._remote, arr.ctypes.data
        for start in range(0, len(spans), _IOV_MAX):
            batch = spans[start:start + _IOV_MAX]
            nbytes = 0
            for k, (address, n) in enumerate(batch):
                remote[k].base, remote[k].len = address, n
                nbytes += n
            local.base, local.len = here, nbytes
            done = call(pid, ctypes.byref(local), 1, remote, len(batch), 0)
            if done != nbytes:
                err = ctypes.get_errno()
                reason = os.strerror(err) if done < 0 else f"moved {done} of {nbytes} bytes"
                raise OSError(err if done < 0 else 0, f"cannot {what} process {pid}: {reason}")
            here += nbytes
