"""Check that every rank holds the same value of something, and say which ranks differ if not."""
from __future__ import annotations

from typing import Any

from .comm.signature import format_ranks

__all__ = ["check_same"]


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
