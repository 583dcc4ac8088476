"""Run every multi-rank test file under real mpirun at 1, 2, 3 and 4 ranks.

The files of one configuration share one launch per rank count (rank_suite.py);
each file is still its own outer test, failing with the inner tests and ranks
that failed.
"""
import pytest

from harness import COLLECTIVE_FILES, RANK_COUNTS, mpirun_cmd

# The variants below change how ranks reach each other (fake nodes, no shared windows, no cross-memory
# copies, no C kernel); a world of one reaches nobody, so none of them runs at 1 rank (the default one does).

FILES = COLLECTIVE_FILES + ["test_safety.py", "test_frameworks.py", "test_torch_training.py",
         "test_tf_training.py", "test_checkpoint.py", "test_compression.py", "test_compression_training.py",
         "test_pipeline.py", "test_tensor_parallel.py", "test_tf_pipeline.py", "test_algorithm_registry.py",
         "test_observe.py", "test_zero.py", "test_tf_zero.py", "test_local_sgd.py", "test_tf_local_sgd.py",
         "test_parameter_server.py", "test_combinations.py",
         "test_cuda.py"]     # (skips without a GPU: scripts/cuda_check.sh runs it on one)
HOROVOD_API = ["test_horovod_api.py", "test_horovod_tf_api.py"]     # (last: they initialise hpctrain.horovod)


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("n", RANK_COUNTS)
@pytest.mark.parametrize("test_file", FILES)
def test_ranks(test_file, n, rank_suites):
    rank_suites.get("default", n, FILES + HOROVOD_API).check_file(test_file)


# The million-value collectives of a variant: every dtype with sum, every op in float32 (a variant changes the
# path, the same for each dtype and op; the default suite runs those at 1-4 ranks and each other pair at one of 2-4:
# collective_inputs.skip_unless_large_pair_runs_here).
LARGE_SUM_OR_FLOAT32 = "not 1000003 or sum or float32"


# At 3 ranks only: nodes of 2 and 1 (a node with several ranks beside one with a single rank); two nodes of 2
# run on the namespace cluster (tests/test_multinode.py, 2x2), and 4 ranks here cost 70 s of CI.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("n", [3])
def test_collectives_on_fake_nodes(n, rank_suites):
    """The hierarchical (inter-node) path: nodes of 2 ranks, small fusion buffers and shared-memory arena
    (2 ranks would make one node)."""
    rank_suites.get("fake-nodes", n, COLLECTIVE_FILES, HPCTRAIN_RANKS_PER_NODE=2, HPCTRAIN_FUSION_THRESHOLD=1 << 20,
                    HPCTRAIN_SHM_ARENA_BYTES=1 << 20, select=LARGE_SUM_OR_FLOAT32).check_files(COLLECTIVE_FILES)


def without_shm_windows(k):
    """mpirun whose one-sided layer cannot allocate shared windows (Open MPI without osc/sm)."""
    return [a if a != "^ucx" else "^sm,ucx" for a in mpirun_cmd(k)]


# The three variants of the one-node paths share the rank counts 2-4 (as CONTRIBUTING says variants do; a world
# of one has no peer to reach): no shared windows at 2, no cross-memory copies at 3, no C kernel at 4.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("n", [2])
def test_without_shared_memory_windows(n, rank_suites):
    """An MPI whose one-sided layer cannot allocate shared windows (Open MPI without osc/sm)."""
    rank_suites.get("no-shm-windows", n, ["test_no_shared_windows.py"],
                    launcher=without_shm_windows).check_file("test_no_shared_windows.py")


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("n", [3])
def test_large_sums_through_the_arena(n, rank_suites):
    """HPCTRAIN_CROSS_MEMORY=0: large one-node all-reduces stage through the shared-memory arena, same results and bits."""
    files = ["test_collectives.py", "test_one_node_paths.py", "test_repeated_calls.py"]
    rank_suites.get("no-cross-memory", n, files, HPCTRAIN_CROSS_MEMORY=0,
                    select="64mib or inplace or shared or copying_between or grouped or large_results",
                    ).check_files(files)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("n", [4])
def test_small_sums_without_the_c_kernel(n, rank_suites):
    """HPCTRAIN_NATIVE_KERNEL=0: the Python exchange does what the C kernel would, with the same results and bits."""
    files = ["test_one_node_paths.py", "test_repeated_calls.py"]
    rank_suites.get("no-c-kernel", n, files, select="repeated_small or rank_order or mismatch",
                    HPCTRAIN_NATIVE_KERNEL=0).check_files(files)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("n", RANK_COUNTS)
@pytest.mark.parametrize("test_file", HOROVOD_API)
def test_horovod_api(test_file, n, rank_suites):
    """hpctrain.horovod's torch and TensorFlow/Keras modules, last in the default launch (one launch fewer a
    rank count): while their module fixture has ``hvd`` initialised its negotiation thread issues every
    collective."""
    rank_suites.get("default", n, FILES + HOROVOD_API).check_file(test_file)
