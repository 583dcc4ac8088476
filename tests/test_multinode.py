"""Ranks on several real (namespace) nodes: own hostname, /dev/shm, /tmp and a shaped network link each.

2 and 3 nodes x 1 and 2 ranks per node, mpirun from node1 over TCP
(tests/cluster_nodes.py).  The rank files run there unchanged: the
collectives against numpy (every algorithm that can run across nodes, the
hierarchical one bit-identical across ranks and repeats), the layout against
the ranks' hostnames, and that no rank sees another node's shared memory or
temporary files.  Skipped, with the reason, where namespaces cannot be made.
"""
import pytest

from cluster_nodes import Cluster, unavailable

LAYOUTS = [(2, 1), (2, 2), (3, 1), (3, 2)]
COLLECTIVES = ("(world_shape or own_shared_memory or test_allreduce or allgather or broadcast or reduce_scatter "
               "or alltoall or bit_identical or shm_refused or grouped_allreduce_equals or narrow_integer) and not 64mib")


@pytest.fixture(scope="session")
def cluster():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    nodes = Cluster.up()
    yield nodes
    nodes.down()


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("nodes, per_node", LAYOUTS)
def test_collectives_across_nodes(nodes, per_node, cluster, rank_suites):
    rank_suites.get(f"nodes-{nodes}x{per_node}", nodes * per_node, ["test_collectives.py"],
                    launcher=lambda n: cluster.mpirun(nodes, per_node), logs_in=str(cluster.shared),
                    select=COLLECTIVES, HPCTRAIN_TEST_RANKS_PER_NODE=str(per_node), **cluster.env,
                    ).check_file("test_collectives.py")
