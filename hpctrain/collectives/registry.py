"""Collective algorithms by name: each one registers itself here, and ``auto`` picks the cheapest that applies.

An algorithm is an :class:`Algorithm`: its name, the collective it performs,
the backends it runs on, the layouts it accepts, a cost estimate and the
function that runs it on a flat numpy buffer.  The built-in all-reduce
algorithms register themselves in their own modules (``native.py``,
``ring.py``, ``shm.py``, ``doubling.py``); adding one is one new module with one
``register(Algorithm(...))`` line, imported before use:

    def gather_sum_broadcast(links, acc, op): ...        # -> the reduced flat buffer
    register(Algorithm("toy", "allreduce", run=gather_sum_broadcast, backends=("mpi",)))
    comm.allreduce(x, algorithm="toy")

Every rank must register the same algorithms before it names one (the call
check compares the name across ranks like any other argument).

``auto`` takes, among the algorithms that run here, the one whose
``cost(where, nbytes)`` is lowest (ties: the first registered).  Costs are
relative to the backend's own library call ("native", cost 1.0); an
algorithm without a cost, or whose cost is None at that size, is used only
when named.  The built-in estimates encode the crossovers that
``hpctrain tune`` measures (the thresholds HPCTRAIN_SHM_MIN_BYTES,
HPCTRAIN_SHM_SMALL_BYTES and HPCTRAIN_HIERARCHICAL_MIN_BYTES), so ``auto``
follows the tuning file.  Cost of a choice: one pass over the registered
algorithms of the collective (a handful); a repeated call reuses its choice.
"""
from __future__ import annotations

import importlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["Algorithm", "Where", "register", "unregister", "algorithms", "lookup", "choose", "on_change"]

ONE_NODE, SEVERAL_NODES = "one node", "several nodes"
# The modules whose import registers the built-in algorithms (each holds its own registration line).
_BUILTIN_MODULES = ("hpctrain.collectives.native", "hpctrain.collectives.ring", "hpctrain.collectives.shm",
                    "hpctrain.collectives.doubling")
_BUILTIN_ORDER = ("native", "ring", "shm", "hierarchical", "doubling")


@dataclass(frozen=True)
class Where:
    """What choosing an algorithm may depend on: the communicator's backend, shape and settings.

    ``shared_memory`` is "" where the ranks of a node can share memory
    windows, else the reason they cannot.  ``reforms``: the world goes on
    after a rank fails (elastic mode), so an algorithm that a failure inside
    it can leave with a wrong answer is left out (``Algorithm.fault_tolerant``).
    """
    backend: str
    size: int
    num_nodes: int
    shared_memory: str
    config: Any
    reforms: bool = False

    @property
    def layout(self) -> str:
        return ONE_NODE if self.num_nodes == 1 else SEVERAL_NODES


@dataclass(frozen=True)
class Algorithm:
    """One algorithm of one collective.

    Args:
        name: what ``algorithm=`` names it by.
        collective: "allreduce" (a reduce-scatter also takes an all-reduce
            algorithm: ``reduce_scatter`` if given, else the full all-reduce
            and the own block).
        run: ``run(links, acc, op) -> flat result``: the all-reduce of the
            flat accumulation buffer ``acc`` (it may reduce in place and
            return ``acc``); ``links`` gives ``rank``, ``size``,
            ``transport`` (point-to-point: ``isend``/``irecv``/``waitall``,
            None where the backend has none), ``native(acc, op)``,
            ``broadcast(raw_bytes, root)`` and ``chunk_elems(itemsize)``.
            None: the backend runs it itself (the shared-memory algorithms,
            which work on the backend's windows).
        reduce_scatter: ``(links, acc, bounds, op) -> own block``, optional.
        backends: the backends it runs on; () for every backend.
        layouts: ``ONE_NODE`` and/or ``SEVERAL_NODES``.
        shared_memory: it needs the node's shared-memory windows.
        cost: ``cost(where, nbytes) -> float or None``, relative to the
            library call (1.0); None (or no function): only when named.
        summary: one line for ``hpctrain info``.
        fault_tolerant: a rank that fails inside it across nodes ends the
            call on every survivor with an error.  False for the library's
            all-reduce: Open MPI's han (its default across nodes) then hands
            the survivors partial sums and no error; a world that re-forms
            does not run it across nodes.
    """
    name: str
    collective: str
    run: Optional[Callable[..., np.ndarray]] = None
    reduce_scatter: Optional[Callable[..., np.ndarray]] = None
    backends: Tuple[str, ...] = ()
    layouts: Tuple[str, ...] = (ONE_NODE, SEVERAL_NODES)
    shared_memory: bool = False
    cost: Optional[Callable[[Where, int], Optional[float]]] = None
    summary: str = ""
    fault_tolerant: bool = True

    def runs_on(self, backend: str) -> bool:
        """Return True if this algorithm is offered on ``backend``."""
        return not self.backends or backend in self.backends

    def refusal(self, where: Where, comm_name: str) -> str:
        """Return why this algorithm cannot run on a communicator at ``where`` ("" if it can)."""
        if self.shared_memory and where.shared_memory:
            return f"algorithm={self.name!r} needs shared memory, but {where.shared_memory}; use 'auto' or 'native'"
        if where.reforms and where.num_nodes > 1 and not self.fault_tolerant:
            return (f"algorithm={self.name!r} is not fault tolerant across nodes (a rank failing inside it can leave "
                    f"the others a wrong result and no error), and {comm_name or 'this world'} re-forms after failures "
                    f"(elastic mode); use 'auto', 'ring' or 'hierarchical'")
        if where.layout not in self.layouts:
            return (f"algorithm={self.name!r} needs every rank of {comm_name} on one node, but it spans "
                    f"{where.num_nodes} nodes; use 'hierarchical' (or 'auto')" if self.layouts == (ONE_NODE,)
                    else f"algorithm={self.name!r} does not run on {where.layout}")
        return ""


_REGISTRY: Dict[str, Dict[str, Algorithm]] = {}
_loaded = False
_listeners: List[weakref.WeakMethod] = []


def on_change(method: Callable[[], None]) -> None:
    """Call the bound ``method`` whenever an algorithm is registered or removed (held weakly).

    Communicators remember the algorithm ``auto`` chose for a repeated call;
    they forget it when the choices change.
    """
    _listeners[:] = [ref for ref in _listeners if ref() is not None]
    _listeners.append(weakref.WeakMethod(method))


def _changed() -> None:
    for ref in list(_listeners):
        method = ref()
        if method is not None:
            method()


def _builtins() -> None:
    """Import the built-in algorithms' modules once, and list the built-ins first, in a fixed order."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)
        order = {name: i for i, name in enumerate(_BUILTIN_ORDER)}
        for collective, table in _REGISTRY.items():
            _REGISTRY[collective] = dict(sorted(table.items(), key=lambda kv: order.get(kv[0], len(order))))


def register(algorithm: Algorithm, replace: bool = False) -> Algorithm:
    """Add ``algorithm`` under its collective and name; a taken name is an error unless ``replace``."""
    if not algorithm.name or algorithm.name == "auto":
        raise ValueError(f"an algorithm needs a name other than 'auto', got {algorithm.name!r}")
    table = _REGISTRY.setdefault(algorithm.collective, {})
    if algorithm.name in table and not replace and table[algorithm.name] is not algorithm:
        raise ValueError(f"a {algorithm.collective} algorithm named {algorithm.name!r} is already registered")
    table[algorithm.name] = algorithm
    _changed()
    return algorithm


def unregister(collective: str, name: str) -> None:
    """Remove a registered algorithm (no error if it is not there)."""
    if _REGISTRY.get(collective, {}).pop(name, None) is not None:
        _changed()


def algorithms(collective: str, backend: Optional[str] = None) -> List[Algorithm]:
    """Return the registered algorithms of ``collective`` (those offered on ``backend`` if given), in order."""
    _builtins()
    return [a for a in _REGISTRY.get(collective, {}).values() if backend is None or a.runs_on(backend)]


def lookup(collective: str, name: str) -> Optional[Algorithm]:
    """Return the algorithm of ``collective`` called ``name``, or None."""
    _builtins()
    return _REGISTRY.get(collective, {}).get(name)


def choose(collective: str, where: Where, nbytes: int) -> Algorithm:
    """Return what ``auto`` runs for ``nbytes`` at ``where``: the lowest cost among those that apply."""
    best, best_cost = None, None
    for algorithm in algorithms(collective, where.backend):
        if algorithm.cost is None or algorithm.refusal(where, ""):
            continue
        cost = algorithm.cost(where, nbytes)
        if cost is not None and (best_cost is None or cost < best_cost):
            best, best_cost = algorithm, cost
    if best is None:
        raise ValueError(f"no {collective} algorithm with a cost estimate runs on the {where.backend} backend")
    return best
