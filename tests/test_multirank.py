"""Run every multi-rank test file under real mpirun at 1, 2, 3 and 4 ranks."""
import pytest

from harness import RANK_COUNTS, mpirun_cmd, run_pytest_on_ranks

FILES = ["test_collectives.py", "test_safety.py", "test_frameworks.py", "test_torch_training.py",
         "test_tf_training.py", "test_checkpoint.py", "test_compression.py", "test_compression_training.py",
         "test_pipeline.py", "test_tensor_parallel.py", "test_tf_pipeline.py"]


@pytest.mark.parametrize("n", RANK_COUNTS)
@pytest.mark.parametrize("test_file", FILES)
def test_ranks(test_file, n):
    run_pytest_on_ranks(n, test_file)


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_collectives_on_fake_nodes(n):
    """The hierarchical (inter-node) path: nodes of 2 ranks, small fusion buffers and shared-memory arena."""
    run_pytest_on_ranks(n, "test_collectives.py", HPCTRAIN_RANKS_PER_NODE=2,
                        HPCTRAIN_FUSION_THRESHOLD=1 << 20, HPCTRAIN_SHM_ARENA_BYTES=1 << 20)


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_without_shared_memory_windows(n):
    """An MPI whose one-sided layer cannot allocate shared windows (Open MPI without osc/sm)."""
    def launcher(k):
        return [a if a != "^ucx" else "^sm,ucx" for a in mpirun_cmd(k)]
    run_pytest_on_ranks(n, "test_no_shared_windows.py", launcher=launcher)


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_large_sums_through_the_arena(n):
    """HPCTRAIN_CROSS_MEMORY=0: large one-node all-reduces stage through the shared-memory arena, same results and bits."""
    run_pytest_on_ranks(n, "test_collectives.py", HPCTRAIN_CROSS_MEMORY=0,
                        select="64mib or inplace or shared or copying_between or grouped or large_results")


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_small_sums_without_the_c_kernel(n):
    """HPCTRAIN_NATIVE_KERNEL=0: the Python exchange does what the C kernel would, with the same results and bits."""
    run_pytest_on_ranks(n, "test_collectives.py", select="repeated_small or rank_order or mismatch",
                        HPCTRAIN_NATIVE_KERNEL=0)
