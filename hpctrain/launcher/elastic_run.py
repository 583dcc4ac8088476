"""Run an elastic launch's mpirun: relay its output, read the ranks' markers and Open MPI's reports of lost nodes."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import List, Optional

from ..launcher_protocol import ELASTIC_FINISHED, ELASTIC_RESTARTING, ELASTIC_STARTED
from .launch import Interrupts, remove_stale_session_dirs

__all__ = ["run_elastic", "PIPE_DRAIN_S"]


# Open MPI's runtime (PRRTE) when a node's daemon is gone: it ends the whole job, whatever ULFM could do for the ranks
_LOST_DAEMON = (re.compile(rb"Remote daemon:\s+\S+ on node (\S+)"),       # lost after the start
                re.compile(rb"^\s*Remote host:\s+(\S+)"))                  # its ssh (launch agent) ended


PIPE_DRAIN_S = 5.0     # how long the launcher reads mpirun's output after mpirun ended


def _drain(readers, grace_s: float = PIPE_DRAIN_S) -> bool:
    """Wait up to ``grace_s`` for the output readers to reach their pipes' end; True when one is still held open."""
    import time

    deadline = time.monotonic() + grace_s
    for reader in readers:
        reader.join(timeout=max(0.0, deadline - time.monotonic()))
    return any(reader.is_alive() for reader in readers)


def run_elastic(cmd: List[str], watch=None, lost: Optional[set] = None, grace_s: Optional[float] = None) -> int:
    """Run an elastic launch's ``cmd`` (mpirun), relaying its output; return the job's exit status.

    Under Open MPI's fault-tolerance extension a process that dies is no error
    of the job (its survivors go on), so mpirun says 0 even when every rank
    died.  Rank 0 prints :data:`ELASTIC_STARTED` when hpctrain starts, and
    rank 0 of the last world :data:`ELASTIC_FINISHED` when it ends normally;
    a job that started so and never finished has its status 0 made 1, with a
    message (a program that never starts hpctrain keeps mpirun's status).
    Ctrl-C and SIGTERM: :class:`Interrupts` (the ranks' preemption signal).
    ``watch()``, when given, is called every HPCTRAIN_ELASTIC_DISCOVERY_S
    seconds while mpirun runs (the discovery script's poll:
    :mod:`hpctrain.launcher.elastic_driver`).  The launch ends when mpirun does:
    its output is read for :data:`PIPE_DRAIN_S` more seconds, not until every
    process that inherited it (a lost node's remote shell) lets go; mpirun
    itself is ended when it has not exited ``grace_s`` (ORPHANED_GRACE_S) after
    the job finished (it waits for ever for a daemon on a frozen node:
    ``end_if_stuck``) or after its last local rank ended (``end_if_orphaned``).
    The hosts whose Open MPI daemon was lost after the job started (a node
    crash: its runtime then ends the whole job, survivors too) are added to
    ``lost`` (read from Open MPI's report, on either stream).
    """
    import threading

    from .elastic_driver import ORPHANED_GRACE_S, end_if_orphaned, end_if_stuck, poll_while
    from .mpirun_output import Relay

    grace_s = ORPHANED_GRACE_S if grace_s is None else grace_s

    # (in the child before it execs mpirun: the stale session folder of the pid mpirun will have)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: remove_stale_session_dirs(pid=os.getpid()))
    interrupts = Interrupts(proc)
    poll_while(proc, watch)
    orphaned = end_if_orphaned(proc, grace_s=grace_s)
    started = finished = False
    daemons_lost: set = set()

    def note_lost(line: bytes) -> None:
        for pattern in _LOST_DAEMON:
            m = pattern.search(line)
            if m:
                daemons_lost.add(m.group(1).decode(errors="replace"))

    said: set = set()

    def writer(stream):
        def write(line: bytes) -> None:
            stream.write(line)
            stream.flush()
        return write

    def relay_errors():
        relay = Relay(writer(sys.stderr.buffer), said)
        for line in iter(proc.stderr.readline, b""):
            relay.line(line)
            note_lost(line)
        relay.close()

    def relay_output():
        nonlocal started, finished
        relay = Relay(writer(sys.stdout.buffer), said)
        for line in iter(proc.stdout.readline, b""):
            started = started or line.startswith(ELASTIC_STARTED.encode())
            if not finished and line.startswith((ELASTIC_FINISHED.encode(), ELASTIC_RESTARTING.encode())):
                finished = True
                end_if_stuck(proc, ended=orphaned, grace_s=grace_s)
            relay.line(line)
            note_lost(line)             # (Open MPI's runtime prints its reports on either stream)
        relay.close()
    readers = [threading.Thread(target=relay_errors, name="hpctrain-stderr", daemon=True),
               threading.Thread(target=relay_output, name="hpctrain-stdout", daemon=True)]
    for reader in readers:
        reader.start()
    code = proc.wait()              # (not the pipes' end: a process mpirun left, such as the remote shell of a
    held = _drain(readers)          # node that went silent, can hold them open for ever)
    if held:
        sys.stderr.write(f"hpctrain launch: {os.path.basename(cmd[0])} ended but a process it left still holds its "
                         f"output open (a remote shell or daemon of a lost node?); not waiting for it\n")
    if interrupts.first is not None:
        return interrupts.status(code if code >= 0 else 128 - code)
    if orphaned.is_set():
        sys.stderr.write(f"hpctrain launch: {os.path.basename(cmd[0])} had not exited {grace_s:g} s after "
                         f"{'the job finished' if finished else 'the last of its ranks ended'} (stuck, or waiting "
                         f"for a lost node's daemon); ended it, exit status {0 if finished else 1}\n")
        return 0 if finished else 1
    if lost is not None and started and not finished:
        lost |= daemons_lost
    if code == 0 and started and not finished:
        if not (lost is not None and daemons_lost):       # (the caller says what follows the loss of a node)
            sys.stderr.write("hpctrain launch: every rank of the elastic job failed (none ended normally); "
                             "exit status 1\n")
        return 1
    return code if code >= 0 else 128 - code
