"""Training state that survives a re-formed world: commit, restore, and make every rank hold the same.

``state.commit()`` (after a step, every ``k`` steps) keeps a copy of the state
in this process's memory, in the checkpoint's encoding (a
:class:`~hpctrain.checkpoint.storage.MemoryStorage`: the values packed as one
safetensors buffer with its CRC-32, verified when read back); after a failure
:func:`hpctrain.elastic.run` re-forms the world and calls :meth:`State.recover`:
the ranks agree on the newest commit every survivor has (a survivor whose
step failed before its commit is one commit behind the others, so the last
two are kept), each restores it, and rank 0's copy is broadcast so that
every rank continues from the same bits.  Cost of a commit: one copy of the
state and one CRC-32 pass over it
(:class:`~hpctrain.torch.elastic_state.TorchState`: the model's and the
optimizer's tensors), no communication; a value the encoding refuses (not
data: an object of the program's own) is kept as a deep copy.  A value
spread over the ranks (a :class:`~hpctrain.torch.ShardedOptimizer`) is
committed as this rank's part plus a copy on a buddy rank of another node
(one all-to-all of ``1/N`` of it), and rebuilt after a re-forming from the
survivors' parts and copies
(:mod:`hpctrain.checkpoint.peer_storage`).
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..checkpoint import Sharded
from ..checkpoint.peer_storage import PeerStorage
from ..checkpoint.storage import MemoryStorage
from ..errors import HpctrainError

__all__ = ["State", "ObjectState"]

KEPT_COMMITS = 2
SPREAD_COMMON = "__spread_common__."      # (+ a spread value's name: its common part, kept as data in a commit)


class State:
    """Base of the elastic states: numbered in-memory commits, agreement on the one to go back to, reset callbacks.

    Subclasses say what a copy is (:meth:`_capture`, :meth:`_apply`) and how
    rank 0's state reaches every rank (:meth:`_sync`).
    """

    def __init__(self):
        self._commits = MemoryStorage(KEPT_COMMITS)      # numbered copies, the last KEPT_COMMITS (checkpoint/storage.py)
        self._peers: Dict[str, PeerStorage] = {}             # a spread value's parts of the same commits, by name
        self._number = 0                                        # commits so far (the number of the newest)
        self.commit_s = 0.0                                     # time of the last commit
        self._reset_callbacks: List[Callable[[], object]] = []
        self._from_disk: Optional[Callable[[], object]] = None

    # -- for subclasses -------------------------------------------------------
    def _capture(self, names: Optional[Sequence[str]] = None, copy_values: bool = True) -> Dict[str, Any]:
        """The values (all, or ``names``) as ``{name: value}``: copies, or with ``copy_values=False`` the live
        values (a commit encodes them at once)."""
        raise NotImplementedError

    def _apply(self, saved: Any) -> None:
        raise NotImplementedError

    def _sync(self, comm) -> None:
        raise NotImplementedError

    # -- public ------------------------------------------------------------------
    @property
    def commit_number(self) -> int:
        """The number of the newest commit (1 for the first; counted per process, put back by a restore)."""
        return self._number

    def save(self) -> None:
        """Keep a copy of the state (in this process's memory) that :meth:`restore` and a re-forming go back to."""
        start = time.perf_counter()
        self._number += 1
        self._commits.save(self._number, self._capture(copy_values=False))
        self.commit_s = time.perf_counter() - start

    def commit(self) -> None:
        """:meth:`save`, then :meth:`check_host_updates`."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """With a host discovery script: act on hosts that came or went (collective; :mod:`hpctrain.elastic.hosts`).

        Ranks on a host that left end here, the others raise
        :class:`~hpctrain.elastic.hosts.HostsChanged` (:func:`hpctrain.elastic.run`
        re-forms the world without them, from this commit); when hosts were
        added new ranks are spawned on them and merged in, and every rank raises
        :class:`~hpctrain.elastic.grow.WorldGrew` (or, where the state cannot
        grow in place, writes the state and exits for the launcher's restart on
        them).  Without a discovery script it does nothing.
        """
        from . import hosts

        if hosts.check(self):
            raise hosts.HostsChanged("hosts left the job (discovery script)")

    def grow_in_place(self, comm, added) -> None:
        """Spawn ranks on ``added`` ``(host, count)``, merge them into the world and share this state with them
        (collective over the world; raises :class:`~hpctrain.elastic.grow.WorldGrew`: :mod:`hpctrain.elastic.grow`)."""
        from .grow import grow

        grow(self, comm, added)

    def restore(self, number: Optional[int] = None) -> None:
        """Go back to commit ``number`` (default: the newest).  Raises HpctrainError when it is not kept."""
        kept = self._commits.list()
        if not kept:
            raise HpctrainError("nothing to restore: commit() the state first")
        n = kept[-1] if number is None else number
        if n not in kept:
            raise HpctrainError(f"commit {number} is not kept here (kept: {kept})")
        self._apply(self._commits.read(n))
        self._number = n
        for later in kept[kept.index(n) + 1:]:
            self._commits.remove(later)
        for peers in self._peers.values():      # (also the parts of a commit whose capture failed half-way)
            for later in [step for step in peers.list() if step > n]:
                peers.remove(later)

    def set_commit_number(self, number: int) -> None:
        """Number the next commit ``number + 1`` (what was loaded from elsewhere was commit ``number``)."""
        self._number = int(number)

    def keep_on_node(self, folder, generation: int) -> None:
        """From the next commit on, keep commits also as files of ``folder`` (the node's memory), named by
        ``generation``, the re-formings since (``epoch``) and the world's rank and size at each commit
        (:class:`~hpctrain.checkpoint.node_storage.NodeLocalStorage`; the commits kept so far are not written)."""
        from ..checkpoint.node_storage import NodeLocalStorage
        from ..world import world

        def where():
            w = world()
            return generation, len(getattr(self, "recoveries", ())), w.rank, w.size

        self.leave_node()
        self._commits = NodeLocalStorage(KEPT_COMMITS, folder, where)
        self._node = (folder, generation, where)
        for name, peers in self._peers.items():
            peers.node = (folder, where, name)

    def spans_ranks(self) -> bool:
        """Whether a value of the state is spread over the ranks (a sharded optimizer: each rank its chunks)."""
        return any(_is_spread(getattr(self, name, None)) for name in getattr(self, "_names", ()))

    def node_generation(self) -> Optional[int]:
        """The generation the node-local commits are named by (None while commits stay in memory only)."""
        node = getattr(self, "_node", None)
        return None if node is None else node[1]

    def leave_node(self):
        """Keep commits in memory only from now on, once the node-local writes under way are done; return the
        folder they went to (None if none)."""
        node, self._node = getattr(self, "_node", None), None
        if node is None:
            return None
        self._commits.wait()
        for peers in self._peers.values():
            peers.wait()
            peers.node = None
        self._commits = self._commits.in_memory()      # (the same parts, without their files' life)
        return node[0]

    def drop_older_node_commits(self) -> None:
        """Remove this job's node-local commits of earlier starts (once this start has committed)."""
        node = getattr(self, "_node", None)
        if node is not None:
            node[0].drop_older(node[1])

    def sync(self, comm=None) -> None:
        """Make every rank's state rank 0's (collective), then commit it."""
        from ..world import comm_or_world

        self._sync(comm_or_world(comm))
        self.save()

    def recover(self, comm=None) -> int:
        """After a re-forming: agree on the newest commit every rank kept, restore it, take rank 0's copy.

        Collective; returns the commit number restored.  Raises HpctrainError
        naming the ranks when no commit is kept on every rank.
        """
        from ..world import comm_or_world

        comm = comm_or_world(comm)
        kept = comm.allgather_object(self._commits.list())
        common = set(kept[0]).intersection(*map(set, kept[1:]))
        if not common:
            raise HpctrainError(f"the ranks kept no common commit to go back to (rank: commits kept): "
                                f"{dict(enumerate(kept))}")
        number = max(common)
        self._recovering = True         # (spread values come back in _recover_spread, from every rank's parts)
        try:
            self.restore(number)
        finally:
            self._recovering = False
        self._recover_spread(comm)
        self._sync(comm)
        return number

    def _recover_spread(self, comm) -> None:
        """Bring back the state spread over the old world's ranks (collective; nothing to do here)."""

    def _peer_storage(self, name: str) -> PeerStorage:
        """Where spread value ``name``'s parts go: over the world of now (a new storage after a re-forming; the old
        one stays with the commits that name it)."""
        from ..world import world

        comm = world()
        peers = self._peers.get(name)
        if peers is None or peers.comm is not comm:
            node = getattr(self, "_node", None)
            peers = self._peers[name] = PeerStorage(comm, KEPT_COMMITS, node and (node[0], node[2], name))
        return peers

    def register_disk_fallback(self, load: Callable[[], object]) -> None:
        """Call ``load()`` on every rank of the re-formed world when the in-memory commit cannot be rebuilt (a
        rank's part and its peer copy both lost): it loads the newest disk checkpoint into the live objects and
        this state's values (``CheckpointManager.restore``, collective), and returns its step; the state is then
        committed anew and training goes on from there.  Without one such a loss ends the job."""
        self._from_disk = load

    def from_disk(self) -> object:
        """Run the disk fallback (:meth:`register_disk_fallback`) and commit what it loaded; return its result.

        Raises the :class:`~hpctrain.checkpoint.peer_storage.PartLost` it was called for when none is registered."""
        from ..checkpoint.peer_storage import PartLost

        if self._from_disk is None:
            raise PartLost("no disk fallback is registered (state.register_disk_fallback)")
        loaded = self._from_disk()
        self.save()
        return loaded

    def register_reset_callbacks(self, callbacks: List[Callable[[], object]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every re-forming, once the state is restored
        (to scale the learning rate to the new size, say)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (:func:`hpctrain.elastic.run` does, after :meth:`recover`)."""
        for cb in self._reset_callbacks:
            cb()


class ObjectState(State):
    """Named values as attributes (``state.epoch``), committed as copies and broadcast from rank 0 by :meth:`sync`.

    ``state = ObjectState(epoch=0, batch=0, sampler=sampler)``; ``state.epoch += 1``; ``state.commit()``.
    A value with ``state_dict()`` and ``load_state_dict()`` (a sampler, an LR
    scheduler, a torch model or optimizer) is committed as its state dict
    (packed, module docstring) and restored in place, so objects that hold it
    (a DataLoader holds its sampler) see the restored state; any other value
    is committed the same way (a deep copy where it is not data) and the
    attribute set again.  Values must be picklable (:meth:`sync`
    sends rank 0's); names in ``local`` are restored but not synced (each
    rank's own, such as its RNG streams).
    """

    def __init__(self, local: Sequence[str] = (), **values: Any):
        super().__init__()
        self._names = sorted(values)
        self._local = set(local)
        for name, value in values.items():
            setattr(self, name, value)
        self.save()

    def _capture(self, names: Optional[Sequence[str]] = None, copy_values: bool = True) -> Dict[str, Any]:
        out = {}
        for name in self._names:        # (a ShardedOptimizer's allgathers in flight finish before anything is read)
            wait = getattr(getattr(self, name), "wait_parameters", None)
            if callable(wait):
                wait()
        for name in self._names if names is None else names:
            value = getattr(self, name)
            if _is_spread(value):           # (a ShardedOptimizer: its own chunks here, a copy on the buddy rank)
                out[name] = _Spread.capture(value, self._peer_storage(name), self._number)
                if getattr(self, "_node", None) is not None:    # (data, for a start from the node's memory)
                    out[SPREAD_COMMON + name] = out[name].common
                continue
            value = value.state_dict() if _has_state_dict(value) else value
            out[name] = copy.deepcopy(value) if copy_values else value
        return out

    def _apply(self, saved: Dict[str, Any]) -> None:
        for name, value in saved.items():
            if name.startswith(SPREAD_COMMON):
                continue
            current = getattr(self, name)
            if isinstance(value, _Spread):
                value.load_own(current, strict=not getattr(self, "_recovering", False))
            elif _has_state_dict(current):      # (the values are the caller's own: a commit's read or a broadcast)
                current.load_state_dict(value)
            else:
                setattr(self, name, value)

    def _sync(self, comm) -> None:
        self._sync_values(comm, ())

    def checkpoint_entries(self) -> Dict[str, Any]:
        """The values as checkpoint entries: rank 0's for the shared ones, each rank's own (``Sharded``) for the
        local ones, and the commit number (a restart on more hosts writes and loads these: elastic/hosts.py)."""
        entries = {name: (Sharded(getattr(self, name), missing="skip") if name in self._local
                          else getattr(self, name)) for name in self._names}
        entries["__commit_number"] = self.commit_number
        return entries

    def load_checkpoint_entries(self, entries: Dict[str, Any]) -> None:
        """Take the values of :meth:`checkpoint_entries` after a checkpoint restored them: the next commit has
        the number after the saved one's."""
        for name in self._names:
            value = entries[name]
            if name not in self._local and value is not getattr(self, name):
                setattr(self, name, value)
        self._number = int(entries["__commit_number"]) - 1

    def _recover_spread(self, comm) -> None:
        """Give each spread value (committed as parts) the chunks of the new world from the old world's parts:
        each old rank's own copy where it survived, else its buddy's (:func:`hpctrain.checkpoint.peer_storage.recover`)."""
        held = self._commits.held(self._commits.list()[-1])
        spread = [(name, value) for name, value in held.items() if isinstance(value, _Spread)]
        for name, value in spread:
            value.load_all(getattr(self, name), comm)
        if spread:      # (commit at once in the new world: its parts, and their copies, are of the new sharding)
            self.save()

    def _sync_values(self, comm, skip: Sequence[str]) -> None:
        """Give every rank rank 0's values, but for the local ones, ``skip`` and the spread ones (each rank holds its
        own part of those: a recovery rebuilds them from the parts) (one pickled broadcast)."""
        names = [n for n in self._names if n not in self._local and n not in skip and not _is_spread(getattr(self, n))]
        if names:
            self._apply(self.broadcast_value(comm, self._capture(names)))

    def broadcast_value(self, comm, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (one pickled broadcast over ``comm``)."""
        return comm.broadcast_object(value, root=0)

    def release_world(self) -> None:
        """Let hpctrain's own collectives run on the world (before the restart's checkpoint; nothing to do here)."""

    def allgather_value(self, comm, value: Any) -> list:
        """Every rank's ``value``, in rank order (one pickled all-gather over ``comm``)."""
        return comm.allgather_object(value)


def _is_spread(value: Any) -> bool:
    return getattr(value, "hpctrain_state_spans_ranks", False) and callable(getattr(value, "shard_state_dict", None))


class _Spread:
    """The commit of a value spread over the ranks: the common part, and the step of its parts in a
    :class:`~hpctrain.checkpoint.peer_storage.PeerStorage` (this rank's own, a copy on the buddy rank)."""

    on_peers = True         # (its parts are in its PeerStorage: a node-local commit holds them there)

    def __init__(self, common, peers: PeerStorage, step: int):
        self.common, self.peers, self.step = common, peers, step

    @classmethod
    def capture(cls, value, peers: PeerStorage, step: int) -> "_Spread":
        if getattr(value, "shard_comm", peers.comm) is not peers.comm:
            raise HpctrainError("an elastic state commits a ShardedOptimizer as parts of the world's ranks: shard "
                                "it over the world (comm=None), not over a group")
        common, own = value.shard_state_dict()
        peers.save(step, own)
        return cls(copy.deepcopy(common), peers, step)

    def __deepcopy__(self, memo) -> "_Spread":
        return self         # (a record of a commit, never changed: a commit's copy of it is itself)

    def load_own(self, value, strict: bool = True) -> None:
        """Put this rank's part back (the world of the commit); in another world only a recovery can
        (:meth:`load_all`): HpctrainError when ``strict``, else left to it."""
        from ..world import world

        w = world()
        if (w.rank, w.size) == (self.peers.rank, self.peers.size):
            part = self.peers.read(self.step)
            value.load_shard_state_dict(self.common, lambda r: part)
        elif strict:
            raise HpctrainError(f"this commit holds rank {self.peers.rank}'s part of a state sharded over "
                                f"{self.peers.size} ranks; this is rank {w.rank} of {w.size}: only a recovery "
                                "(hpctrain.elastic.run) can bring it back here")

    def load_all(self, value, comm) -> None:
        parts = self.peers.recover(self.step, comm)
        value.load_shard_state_dict(self.common, parts.__getitem__)


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
