"""Grouped all-reduce: many tensors in fusion buffers, one collective per buffer (a mixin of Reductions).

``plan_grouped`` packs the tensors by dtype into groups of at most
HPCTRAIN_FUSION_THRESHOLD bytes (:mod:`hpctrain.collectives.fusion`),
chooses each group's algorithm and remembers the plan of a repeated list.
On one node's shared memory a group is reduced straight from its members
(in place, into them); otherwise it is packed into a fusion buffer,
all-reduced and unpacked.  Cost of a repeated call: one dict lookup and
one conversion per tensor.
"""
from __future__ import annotations

import zlib
from typing import List, Optional, Sequence

import numpy as np

from ...collectives.flat import Flat
from ...collectives.fusion import fusion_groups
from ...collectives.ops import accumulation_dtype, check_op, finish
from ...tensors import to_numpy
from ..call.handle import Plan
from .inplace import copy_back_into
from ..call.signature import Call

__all__ = ["GroupedReductions"]


def _disjoint(arrays: Sequence[np.ndarray]) -> bool:
    """Return True if no two of ``arrays`` overlap in memory (then they can be reduced in place as one buffer)."""
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


class GroupedReductions:
    """``grouped_allreduce`` of :class:`hpctrain.comm.ops.reductions.Reductions` (uses its ``_c``, ``choose``,
    ``fusion``, ``results``, ``measured`` and all-reduce paths)."""

    def plan_grouped(self, xs, op, algorithm, inplace) -> Plan:
        def build(seq):
            if isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__"):
                raise TypeError(f"grouped_allreduce needs a list of tensors, got {type(xs).__name__}")
            items = list(xs)
            converted = [to_numpy(x) for x in items]
            arrs = [a for a, _ in converted]
            # a training loop repeats one list: its plan depends only on the dtypes, shapes, op and algorithm
            key = (op, algorithm, tuple((a.dtype, a.shape) for a in arrs))
            plan = self.seen_grouped.get(key)
            if plan is None:
                dtype_set = {a.dtype for a in arrs}
                for d in dtype_set:
                    check_op(op, d)
                groups = fusion_groups(arrs, self._c._rt.config.fusion_threshold)
                algs = [self.choose(algorithm, g.numel * arrs[g.members[0]].itemsize) for g in groups]
                shapes = repr([(a.dtype.str, a.shape) for a in arrs]).encode()
                plan = (groups, algs, "+".join(sorted(str(d) for d in dtype_set)), sum(a.size for a in arrs),
                        f"{len(arrs)} tensors/{zlib.crc32(shapes):08x}")
                if len(self.seen_grouped) > 64:
                    self.seen_grouped.clear()
                self.seen_grouped[key] = plan
            groups, algs, dtypes, total, layout = plan
            call = Call("grouped_allreduce", seq, dtypes, (total,), op=op, algorithm=algorithm, layout=layout)
            restores = [copy_back_into(x, a, r) if inplace else r for x, (a, r) in zip(items, converted)]
            return (call, lambda: self._do_grouped(arrs, groups, algs, op, inplace, algorithm),
                    lambda outs: [r(o) for r, o in zip(restores, outs)])
        return self._c._calls.build("grouped_allreduce", build, op=op, algorithm=algorithm)

    def _do_grouped(self, arrs: List[np.ndarray], groups, algs: List[str], op: str,
                    inplace: bool = False, asked: str = "auto") -> List[np.ndarray]:
        outs: List[Optional[np.ndarray]] = [None] * len(arrs)
        tl = self._c._rt.timeline
        for g, alg in zip(groups, algs):
            dtype = arrs[g.members[0]].dtype
            if tl.on:
                with tl.span("fusion buffer", "fusion", tensors=len(g.members), bytes=int(g.numel * dtype.itemsize),
                             dtype=str(dtype), algorithm=alg):
                    self._do_group(arrs, outs, g, alg, dtype, op, inplace, asked)
            else:
                self._do_group(arrs, outs, g, alg, dtype, op, inplace, asked)
        return outs

    def _do_group(self, arrs, outs, g, alg: str, dtype, op: str, inplace: bool, asked: str) -> None:
        """All-reduce one fusion group of ``arrs`` and put its members' results into ``outs``."""
        nbytes = g.numel * dtype.itemsize
        if self.measuring(asked, alg, nbytes):
            # (probed as one all-reduce of the group's packed size)
            self.measured.run("allreduce", nbytes, lambda way: self._group_by(arrs, outs, g, way, dtype, op, inplace),
                              lambda a, way: self._allreduce_by(a, op, way, True), ((g.numel,), dtype))
        else:
            self._group_by(arrs, outs, g, alg, dtype, op, inplace)

    def _group_by(self, arrs, outs, g, alg: str, dtype, op: str, inplace: bool) -> None:
        if self.shared_alg(alg) and self._c._size > 1:
            members = [arrs[i] for i in g.members]
            if inplace and accumulation_dtype(dtype) == dtype and _disjoint(members):
                # the results go straight into the inputs (each part is read before it is written):
                # no result buffer and nothing to copy back; with direct copies, no copy at all
                self._c._backend.allreduce_shared(Flat(members), Flat(members), op, alg, self._divisor(op))
                for i in g.members:
                    outs[i] = arrs[i]
                return
            # the results are views of one buffer from the result pool: no page faults once it is warm,
            # and the buffer is reused only when the caller has dropped all of them
            acc = self.results.empty(g.numel, accumulation_dtype(dtype))
            self._c._backend.allreduce_shared(Flat(members), Flat([acc]), op, alg, self._divisor(op))
            for i, off, n in zip(g.members, g.offsets, g.numels):
                outs[i] = finish(acc[off:off + n], op, 1, dtype).reshape(arrs[i].shape)   # (divided already)
            return
        flat = self._do_allreduce(self.fusion.pack(arrs, g), op, alg, inplace=True)
        for i, off, n in zip(g.members, g.offsets, g.numels):
            outs[i] = flat[off:off + n].reshape(arrs[i].shape).copy()
