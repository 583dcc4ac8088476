"""The whole state of a torch ShardedOptimizer: gathered into the plain optimizer's format, or spread as each
rank's chunks (a checkpoint), and loaded back from either at any world size.

``shards`` in these functions is the optimizer's :class:`hpctrain.torch.zero._Shards`; ``outer`` the optimizer.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..optim.zero import SHARDS_FORMAT, layout_record, per_element, reshard_copies

__all__ = ["consolidate", "load", "shard_state", "load_shards"]


def consolidate(shards, outer, to: Optional[int]) -> None:
    """Gather every chunk's state into a plain state dict of ``outer``'s parameters, kept on rank ``to``
    (every rank for None).  Collective: one allgather per per-element state of each bucket."""
    shards.wait_parameters()
    sync, layout = shards.sync, shards.layout
    index = _indices(outer)
    state: Dict[int, dict] = {}
    for b, bucket in enumerate(sync.buckets):
        chunk = shards.chunks[b]
        own = {} if shards.inner is None else shards.inner.state.get(chunk, {})
        for key in sorted(own):
            value = own[key]
            if per_element(key, value, chunk.shape):
                padded = torch.zeros(layout.chunks[b], dtype=value.dtype, device=value.device)
                padded[:len(chunk)] = value
                flat = shards.comm.allgather(padded)
                for i, off, n in zip(bucket.members, bucket.offsets, bucket.numels):
                    p = sync.params[i]
                    state.setdefault(index[id(p)], {})[key] = flat[off:off + n].reshape(p.shape).clone()
            else:
                for i in bucket.members:
                    v = value.clone() if torch.is_tensor(value) else value
                    state.setdefault(index[id(sync.params[i])], {})[key] = v
    keep = to is None or shards.comm.rank == to
    groups = torch.optim.Optimizer.state_dict(outer)["param_groups"]
    shards.consolidated = {"state": state, "param_groups": groups} if keep else None
    shards.consolidated_for = shards.steps

def shard_state(shards, outer) -> tuple:
    """``(common, own)``: what every rank has alike (the layout, per-tensor states, param groups) and this
    rank's chunks of the per-element states (a checkpoint's shard file)."""
    shards.wait_parameters()
    index = _indices(outer)
    keys, scalars, own = [], [], {}
    for b, chunk in enumerate(shards.chunks):
        st = {} if shards.inner is None else shards.inner.state.get(chunk, {})
        moments = sorted(k for k, v in st.items() if per_element(k, v, chunk.shape))
        keys.append(moments)
        scalars.append({k: v for k, v in st.items() if k not in moments})
        own[f"b{b}"] = {k: st[k] for k in moments}
    common = {"format": SHARDS_FORMAT, "world": shards.comm.size, "per_element": keys, "scalars": scalars,
              "buckets": layout_record(shards.layout, shards.sync.buckets, [index[id(p)] for p in shards.sync.params]),
              "param_groups": torch.optim.Optimizer.state_dict(outer)["param_groups"]}
    return common, own

def load_shards(shards, outer, common: dict, read) -> None:
    """Take this rank's chunks from a saved sharding of any size: ``read(rank)`` gives a saved rank's ``own``."""
    shards.wait_parameters()
    torch.optim.Optimizer.load_state_dict(outer, {"state": {}, "param_groups": common["param_groups"]})
    index = _indices(outer)
    index_of = [index[id(p)] for p in shards.sync.params]
    saved_bucket = {int(idx): sb for sb, rec in enumerate(common["buckets"]) for idx, _, _ in rec["members"]}
    states: List[dict] = []
    for b, bucket in enumerate(shards.sync.buckets):       # (zeros and per-tensor states first: every chunk has them)
        sb = saved_bucket.get(index_of[bucket.members[0]])
        st = {} if sb is None else {k: v.clone() if torch.is_tensor(v) else v for k, v in common["scalars"][sb].items()}
        for k in [] if sb is None else common["per_element"][sb]:
            st[k] = torch.zeros(len(shards.chunks[b]), dtype=shards.chunks[b].dtype, device=shards.chunks[b].device)
        states.append(st)
    cache: Dict[int, dict] = {}
    for b, lo, hi, rank, sb, slo in reshard_copies(common["buckets"], shards.layout, shards.sync.buckets, index_of):
        if rank not in cache:
            cache[rank] = read(rank)
        for key, src in cache[rank][f"b{sb}"].items():
            dst = states[b][key]
            dst[lo:hi] = torch.as_tensor(src[slo:slo + hi - lo]).to(dst.device, dst.dtype)
    if shards.inner is not None:
        for chunk, st in zip(shards.chunks, states):
            shards.inner.state.pop(chunk, None)
            if st:
                shards.inner.state[chunk] = st
    shards.consolidated = None

def load(shards, outer, state_dict: dict) -> None:
    """Keep this rank's chunks of a plain state dict's per-element states, and its per-tensor ones."""
    shards.wait_parameters()
    index = _indices(outer)
    states = state_dict["state"]
    for b, bucket in enumerate(shards.sync.buckets):
        chunk, mine = shards.chunks[b], {}
        for i, lo, hi, plo, phi in shards.parts[b]:
            p = shards.sync.params[i]
            for key, value in states.get(index[id(p)], {}).items():
                if per_element(key, value, p.shape):
                    if key not in mine:
                        mine[key] = torch.zeros(len(chunk), dtype=value.dtype, device=chunk.device)
                    if lo < hi:
                        mine[key][lo:hi] = value.reshape(-1)[plo:phi].to(chunk.device)
                elif key not in mine:
                    mine[key] = value.clone() if torch.is_tensor(value) else value
        if shards.inner is not None:
            shards.inner.state.pop(chunk, None)
            if mine:
                shards.inner.state[chunk] = mine
    shards.consolidated = None


def _indices(optimizer) -> Dict[int, int]:
    """Each parameter's index in a state dict of ``optimizer`` (torch numbers them over the groups in order)."""
    out: Dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.setdefault(id(p), len(out))
    return out
