"""An alpha-beta cost model of all-reduce across nodes: ring, hierarchical and tree, and what ``auto`` takes from it.

``S`` bytes on ``n`` nodes of ``k`` ranks each (``p = n k`` ranks); every
node has one link, ``beta`` seconds per byte each way, and ``alpha`` seconds
of latency per message; ``gamma`` is the time per byte of one pass over a
rank's data in the node's memory (copy or reduction, the ``k`` ranks of a
node sharing its memory bandwidth).

* ring over all ``p`` ranks (ranks of a node next to each other, so each
  link carries one ring edge each way): ``2 (p-1)`` steps of ``S/p`` bytes,
  ``T = 2 (p-1) alpha + 2 (p-1)/p S beta + k (p-1)/p S gamma`` (the last
  term: the node's ranks adding what arrives);
* hierarchical (:mod:`hpctrain.collectives.shm`): the node's ranks reduce
  through shared memory into ``k`` segments (about 3 passes over ``S`` per
  rank: copy in, reduce, copy out), then ``k`` rings over the ``n`` nodes,
  one per segment, share the link, ``T = 2 (n-1) alpha + 2 (n-1)/n S beta
  + (3 k + (n-1)/n) S gamma``; it sends ``2 (n-1)/n S`` per link where the
  ring sends ``2 (p-1)/p S``;
* tree (recursive doubling, a flat MPI's choice for small messages):
  ``ceil(log2 p)`` rounds of the whole ``S``, of which the ``ceil(log2 n)``
  that cross nodes put ``k S`` on each link (the others stay in the node's
  memory), ``T = ceil(log2 n) alpha + ceil(log2 n) k S beta +
  ceil(log2 p) k S gamma``.

``alpha`` counts the steps that send over the links; steps inside a node
cost memory passes only.

Each formula is linear in ``(alpha, beta, gamma)`` (:func:`terms`), so
``benchmarks/model.py`` fits the three by least squares on measured times.
``auto`` across nodes (:func:`hierarchical_cost`) compares the hierarchical
algorithm with the backend's library call, modelled as a flat MPI (the better
of tree and ring): an MPI with its own hierarchical all-reduce (Open MPI 5's
``han``) matches ``hierarchical`` on large buffers, which the model does not
know.  Cost of an estimate: a few float operations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

__all__ = ["LinkModel", "terms", "predict", "ALGORITHMS", "hierarchical_cost"]

ALGORITHMS = ("ring", "hierarchical", "tree")


@dataclass(frozen=True)
class LinkModel:
    """The model's constants: ``alpha`` s per message, ``beta`` s per byte on a link, ``gamma`` s per byte in memory."""

    alpha: float
    beta: float
    gamma: float

    @classmethod
    def from_config(cls, config) -> "LinkModel":
        """The constants of a :class:`~hpctrain.comm.life.runtime.Config`.

        From HPCTRAIN_LINK_GBIT, HPCTRAIN_LINK_LATENCY_US and HPCTRAIN_MEMORY_GBPS.
        """
        return cls(alpha=config.link_latency_us * 1e-6, beta=8 / (config.link_gbit * 1e9),
                   gamma=1 / (config.memory_gbps * 1e9))


def terms(algorithm: str, nbytes: float, nodes: int, per_node: int) -> Tuple[float, float, float]:
    """The coefficients ``(a, b, c)`` of ``T = a alpha + b beta + c gamma`` for ``algorithm`` (module docstring)."""
    n, k, s = nodes, per_node, float(nbytes)
    p = n * k
    if algorithm == "ring":
        return 2 * (p - 1), 2 * (p - 1) / p * s, k * (p - 1) / p * s
    if algorithm == "hierarchical":
        return 2 * (n - 1), 2 * (n - 1) / n * s, (3 * k + (n - 1) / n) * s
    if algorithm == "tree":
        crossing = math.ceil(math.log2(n)) if n > 1 else 0
        return crossing, crossing * k * s, (math.ceil(math.log2(p)) if p > 1 else 0) * k * s
    raise ValueError(f"no model of {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def predict(model: LinkModel, algorithm: str, nbytes: float, nodes: int, per_node: int) -> float:
    """Seconds the model gives ``algorithm`` for an all-reduce of ``nbytes`` on ``nodes`` x ``per_node`` ranks."""
    a, b, c = terms(algorithm, nbytes, nodes, per_node)
    return a * model.alpha + b * model.beta + c * model.gamma


def hierarchical_cost(model: LinkModel, nbytes: int, nodes: int, per_node: int) -> float:
    """``auto``'s cost of the hierarchical all-reduce: its modelled time over a flat library call's (tree or ring)."""
    library = min(predict(model, "tree", nbytes, nodes, per_node), predict(model, "ring", nbytes, nodes, per_node))
    return predict(model, "hierarchical", nbytes, nodes, per_node) / max(library, 1e-12)
