"""Check that every rank holds the same value of something, and say which ranks differ if not."""
from __future__ import annotations

import os
from typing import Any

from .errors import format_ranks

__all__ = ["check_same", "check_writable", "disagreeing_settings", "writable"]


def check_same(comm, what: str, value: Any, shown: Any = None) -> None:
    """Raise ValueError on every rank unless ``value`` is equal on all ranks of ``comm``.

    Collective (one ``allgather_object``).  The message groups the ranks by the
    value they hold, using ``shown`` (default ``value``) as its description.

    Args:
        comm: the communicator whose ranks must agree.
        what: what the value is, for the message ("the parameter list").
        value: something small, picklable and comparable with ``==``.
        shown: a short readable form of ``value`` for the message.
    """
    entries = comm.allgather_object((value, value if shown is None else shown))
    if all(v == entries[0][0] for v, _ in entries):
        return
    groups = []
    for r, (v, s) in enumerate(entries):
        for g in groups:
            if g[0] == v:
                g[2].append(r)
                break
        else:
            groups.append((v, s, [r]))
    lines = "\n".join(f"  {format_ranks(ranks)}: {s}" for _, s, ranks in groups)
    raise ValueError(f"ranks of {comm.name} disagree on {what}:\n{lines}")


def writable(path: str) -> str:
    """Return why this process cannot create the file ``path`` ("" if it can).

    Creates the missing folders of ``path`` and a probe file beside it, then
    removes the probe (the only reliable test: ``os.access`` says yes to root
    on folders it cannot create files in, such as those under ``/proc``).
    """
    folder = os.path.dirname(os.path.abspath(path))
    probe = os.path.join(folder, f".{os.path.basename(path)}.probe-{os.getpid()}")
    try:
        if os.path.isdir(path):
            return "it is a directory, not a file"
        os.makedirs(folder, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        return f"cannot create a file there ({type(exc).__name__}: {exc})"
    return ""


def check_writable(comm, path: str, writer: int = 0) -> str:
    """Return, on every rank, why rank ``writer`` cannot create the file ``path`` ("" if it can).

    Collective (one ``broadcast_object``): only ``writer`` tries (see
    :func:`writable`), so a path that exists on its node alone is fine.
    """
    why = writable(path) if comm.rank == writer else None
    why = comm.broadcast_object(why, root=writer)
    return f"on rank {writer}, {why}" if why else ""


def disagreeing_settings(allgather_object, values: dict) -> str:
    """Return, on every rank, which of ``values`` (setting name -> this rank's value) differ across ranks ("" none).

    Collective: ``allgather_object(obj) -> every rank's obj``, the backend's
    own (unchecked) one, since the call check may be among the settings that
    differ.  Each setting that differs, with the ranks grouped by the value
    they hold, joined by " | " (one line for the job's one error line).
    """
    everyone = allgather_object(values)
    lines = []
    for name in values:
        groups: dict = {}
        for rank, theirs in enumerate(everyone):
            groups.setdefault(repr(theirs.get(name)), []).append(rank)
        if len(groups) > 1:
            held = "; ".join(f"{format_ranks(ranks)}: {value}" for value, ranks in groups.items())
            lines.append(f"{name} ({held})")
    return " | ".join(lines)
