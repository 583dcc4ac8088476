"""Process layouts for hybrid parallelism: data x pipeline x tensor parallel coordinates and groups.

With axis sizes ``dp``, ``pp``, ``tp`` and an ``order`` that lists the axes
from the fastest-varying to the slowest (default ``"tp-pp-dp"``, Megatron's:
tensor-parallel peers are neighbouring ranks, so they share a node), a rank's
coordinates are the digits of its rank in that mixed radix:

    rank = c[a0] + s[a0] * (c[a1] + s[a1] * c[a2])     for order a0-a1-a2

Worked example, 8 ranks, ``dp=2, pp=2, tp=2``, order ``tp-pp-dp``:

    rank:  0  1  2  3  4  5  6  7
    tp:    0  1  0  1  0  1  0  1
    pp:    0  0  1  1  0  0  1  1
    dp:    0  0  0  0  1  1  1  1

so the tensor-parallel groups are {0,1} {2,3} {4,5} {6,7}, the pipeline
groups {0,2} {1,3} {4,6} {5,7}, and the data-parallel groups {0,4} {1,5}
{2,6} {3,7}.  The group of an axis holds the ranks whose other coordinates
are equal, ordered by their coordinate on that axis (so a rank's rank in its
pipeline group is its stage).  Building the groups is collective over the
communicator (one ``split`` per axis).
"""
from __future__ import annotations

from typing import Dict, List

__all__ = ["ParallelLayout", "AXES"]

AXES = ("dp", "pp", "tp")


class ParallelLayout:
    """This rank's coordinates on the dp, pp and tp axes and the sub-communicator of each axis.

    Args:
        dp, pp, tp: the axis sizes; their product must be the communicator's size.
        order: the axes from fastest- to slowest-varying, joined by "-".
        comm: the communicator to lay out (default: the world).

    Raises ValueError, on every rank alike (each rank checks the same
    numbers), for a product that is not the world size, a size below 1, or
    an order that is not a permutation of dp, pp and tp.
    """

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, order: str = "tp-pp-dp", comm=None):
        if comm is None:
            from ..world import world
            comm = world()
        sizes = {"dp": dp, "pp": pp, "tp": tp}
        for axis, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"ParallelLayout: {axis} must be a positive int, got {size!r}")
        axes = [a.strip() for a in str(order).split("-")]
        unknown = [a for a in axes if a not in AXES]
        if unknown or sorted(axes) != sorted(AXES):
            raise ValueError(f"ParallelLayout: order {order!r} must name each of {', '.join(AXES)} once, "
                             f"joined by '-' (e.g. 'tp-pp-dp')" + (f"; unknown: {unknown}" if unknown else ""))
        if dp * pp * tp != comm.size:
            raise ValueError(f"ParallelLayout: dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp} ranks, but the "
                             f"communicator {comm.name} has {comm.size}")
        self.sizes, self.order, self.comm = sizes, tuple(axes), comm
        self.coords = self.coords_of(comm.rank)
        self._comms: Dict[str, object] = {}
        for axis in AXES:                     # every rank splits in the same order: collective, in step
            others = [a for a in self.order if a != axis]
            color = 0
            for a in reversed(others):
                color = color * sizes[a] + self.coords[a]
            self._comms[axis] = comm.split(color, key=self.coords[axis])

    def __repr__(self) -> str:
        dims = ", ".join(f"{a}={self.sizes[a]}" for a in AXES)
        return f"ParallelLayout({dims}, order={'-'.join(self.order)!r}; rank {self.comm.rank} at {self.coords})"

    def coords_of(self, rank: int) -> Dict[str, int]:
        """The coordinates of ``rank``: its digits in the mixed radix of ``order``."""
        coords, rest = {}, int(rank)
        for axis in self.order:
            coords[axis] = rest % self.sizes[axis]
            rest //= self.sizes[axis]
        return coords

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates (missing axes: this rank's)."""
        c = dict(self.coords, **coords)
        rank = 0
        for axis in reversed(self.order):
            if not 0 <= c[axis] < self.sizes[axis]:
                raise ValueError(f"coordinate {axis}={c[axis]} outside 0..{self.sizes[axis] - 1}")
            rank = rank * self.sizes[axis] + c[axis]
        return rank

    def group(self, axis: str) -> List[int]:
        """The ranks (of ``comm``) in this rank's group along ``axis``, in coordinate order."""
        self._check_axis(axis)
        return [self.rank_of(**{axis: i}) for i in range(self.sizes[axis])]

    def comm_of(self, axis: str):
        """The sub-communicator along ``axis`` (this rank's rank in it is its coordinate)."""
        self._check_axis(axis)
        return self._comms[axis]

    def _check_axis(self, axis: str) -> None:
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; expected one of {', '.join(AXES)}")

    @property
    def dp_comm(self):
        return self._comms["dp"]

    @property
    def pp_comm(self):
        return self._comms["pp"]

    @property
    def tp_comm(self):
        return self._comms["tp"]

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.coords["pp"]

    @property
    def num_stages(self) -> int:
        return self.sizes["pp"]

    def free(self) -> None:
        """Free the sub-communicators."""
        for c in self._comms.values():
            if c is not None and c is not self.comm:
                c.free()
        self._comms = {}
