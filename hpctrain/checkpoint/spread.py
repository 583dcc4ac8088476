"""States spread over the ranks: their formats, and how a checkpoint loads one into a target that is not of the
kind that saved it.

An optimizer wrapper whose state is not alike on every rank writes it as a common
part plus each rank's own (``shard_state_dict``); the common part's ``"format"``
says which restore rule applies: ``load_shard_state_dict`` of the same kind of
wrapper, or :func:`load_spread` for another target.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List

__all__ = ["SHARDS_FORMAT", "LOCAL_SGD_FORMAT", "RANK_STATES_FORMAT", "whole_states", "load_spread"]

SHARDS_FORMAT = "hpctrain-zero/1"               # ZeRO: each rank's chunks (hpctrain.optim.zero)
LOCAL_SGD_FORMAT = "hpctrain-local-sgd/1"       # local SGD / DiLoCo (hpctrain.optim.local_sgd)
RANK_STATES_FORMAT = "hpctrain-rank-states/1"   # each rank's own optimizer state (op='adasum')


def whole_states(common: dict, read: Callable[[int], dict], cat: Callable[[List[Any]], Any]) -> Dict[int, dict]:
    """Every tensor's whole optimizer state from a saved sharding (a checkpoint's ``common`` and ranks' parts):
    ``{tensor index: {key: flat values (per-element states) or the per-tensor value}}``.

    ``read(rank)`` gives a saved rank's part (``{"b<bucket>": {key: its chunk}}``), ``cat`` joins a list of
    chunks into one flat array: the chunks of ranks ``0..N-1`` of a bucket are its ``n`` elements in order
    (:class:`hpctrain.optim.zero.ShardLayout`).  This is how a sharded checkpoint restores into an optimizer
    that is not sharded.
    Cost: every saved rank's part read once; one copy of the whole state.
    """
    world = int(common["world"])
    parts = [read(r) for r in range(world)]
    out: Dict[int, dict] = {}
    for sb, rec in enumerate(common["buckets"]):
        flats = {}
        for key in common["per_element"][sb]:
            missing = [r for r in range(world) if key not in parts[r].get(f"b{sb}", {})]
            if missing:
                raise ValueError(f"the saved sharding lacks ranks {missing}' chunks of state {key!r} of bucket {sb}")
            flats[key] = cat([parts[r][f"b{sb}"][key] for r in range(world)])
        for idx, off, n in rec["members"]:
            st = out.setdefault(int(idx), dict(common["scalars"][sb]))
            for key, flat in flats.items():
                st[key] = flat[int(off):int(off) + int(n)]
    return out


_SPREAD_NAMES = {SHARDS_FORMAT: "a ShardedOptimizer's state (ZeRO)",
                 RANK_STATES_FORMAT: "an optimizer state that is each rank's own (DistributedOptimizer with "
                                     "op='adasum')",
                 LOCAL_SGD_FORMAT: "a LocalSGDOptimizer's state (local SGD / DiLoCo: each rank's own parameters and "
                                   "inner optimizer state)"}


def load_spread(key: str, target: Any, common: dict, read) -> None:
    """Load an entry saved spread over the ranks (its ``common`` part; ``read(rank)``: a saved rank's part).

    Into an object of the kind that saved it (``load_shard_state_dict``: a
    ShardedOptimizer at any world size, a LocalSGDOptimizer); a ZeRO state
    into a plain torch optimizer gathered whole (every saved rank's part read,
    :func:`whole_states`); anything else is refused with
    ValueError naming the entry, so that no state is dropped in silence.
    """
    fmt = common.get("format") if isinstance(common, dict) else None
    if callable(getattr(target, "load_shard_state_dict", None)) and fmt == getattr(target, "hpctrain_state_format",
                                                                                   SHARDS_FORMAT):
        target.load_shard_state_dict(common, read)
        return
    torch = sys.modules.get("torch")
    if fmt == SHARDS_FORMAT and torch is not None and isinstance(target, torch.optim.Optimizer) \
            and "param_groups" in common:
        params = [p for group in target.param_groups for p in group["params"]]
        whole = whole_states(common, read, lambda chunks: torch.cat([torch.as_tensor(c).reshape(-1) for c in chunks]))
        bad = sorted(i for i in whole if i >= len(params))
        if bad:
            raise ValueError(f"the checkpoint's {key!r} has optimizer state for tensors {bad[:5]}, but state[{key!r}] "
                             f"has {len(params)} parameters")
        moments = set().union(*common["per_element"])
        state = {i: {k: v.reshape(params[i].shape).clone() if k in moments else
                     v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for i, st in whole.items()}
        target.load_state_dict({"state": state, "param_groups": common["param_groups"]})
        return
    saved = _SPREAD_NAMES.get(fmt, f"a state spread over the ranks ({fmt})")
    world = common.get("world", "?") if isinstance(common, dict) else "?"
    raise ValueError(f"the checkpoint's {key!r} is {saved}, spread over {world} ranks, and state[{key!r}] is a "
                     f"{type(target).__name__}, which cannot take it: restore it into the same wrapper (at any world "
                     f"size){_SPREAD_HINTS.get(fmt, '')}")


_SPREAD_HINTS = {SHARDS_FORMAT: ", or into a plain torch optimizer (gathered whole); a Keras optimizer takes it only "
                                "through ShardedOptimizer",
                 LOCAL_SGD_FORMAT: " (a LocalSGDOptimizer of the same settings); a plain optimizer would take one "
                                   "rank's parameters and inner state and drop the rest"}
