"""Slurm helpers: expand host lists and task counts into launcher arguments.

    python -m hpctrain.slurm hosts      # "node1:4,node2:4" for horovodrun -H, from SLURM_* variables
"""
from __future__ import annotations

import os
import re
import sys
from typing import List, Mapping, Optional

__all__ = ["expand_hostlist", "expand_tasks_per_node", "horovod_hosts"]


def expand_hostlist(spec: str) -> List[str]:
    """Expand a Slurm host list: ``"a[01-03,7],b"`` -> ``["a01", "a02", "a03", "a7", "b"]``.

    Ranges keep their zero padding; several bracket groups in one name
    (``"r[1-2]n[1-2]"``) expand as a product, as ``scontrol show hostnames`` does.
    """
    hosts: List[str] = []
    for item in _split_top(spec):
        names = [""]
        for text, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            names = [n + text for n in names]
            if group:
                names = [n + v for n in names for v in _expand_range(group, item)]
        hosts += [n for n in names if n]
    return hosts


def _split_top(spec: str) -> List[str]:
    """Split on commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in spec.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"unbalanced brackets in Slurm host list {spec!r}")
    return [p for p in parts + [cur] if p]


def _expand_range(group: str, item: str) -> List[str]:
    out = []
    for part in group.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise ValueError(f"bad range {part!r} in Slurm host list {item!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"descending range {part!r} in Slurm host list {item!r}")
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return out


def expand_tasks_per_node(spec: str) -> List[int]:
    """Expand ``SLURM_TASKS_PER_NODE``: ``"4(x2),3"`` -> ``[4, 4, 3]``."""
    out: List[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"bad SLURM_TASKS_PER_NODE entry {part!r} in {spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def horovod_hosts(env: Optional[Mapping[str, str]] = None) -> str:
    """Return ``host:slots,...`` for ``horovodrun -H`` from SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE."""
    env = os.environ if env is None else env
    try:
        hosts = expand_hostlist(env["SLURM_JOB_NODELIST"])
        slots = expand_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
    except KeyError as exc:
        raise ValueError(f"{exc.args[0]} is not set: run this inside a Slurm allocation") from None
    if len(hosts) != len(slots):
        raise ValueError(f"SLURM_JOB_NODELIST has {len(hosts)} hosts but SLURM_TASKS_PER_NODE "
                         f"{len(slots)} entries")
    return ",".join(f"{h}:{s}" for h, s in zip(hosts, slots))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["hosts"]:
        print("usage: python -m hpctrain.slurm hosts", file=sys.stderr)
        return 2
    try:
        print(horovod_hosts())
    except ValueError as exc:
        print(f"hpctrain: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
