"""Run every multi-rank test file under real mpirun at 1, 2, 3 and 4 ranks."""
import pytest

from harness import RANK_COUNTS, run_pytest_on_ranks

FILES = ["test_collectives.py", "test_safety.py", "test_frameworks.py", "test_torch_training.py",
         "test_checkpoint.py"]


@pytest.mark.parametrize("n", RANK_COUNTS)
@pytest.mark.parametrize("test_file", FILES)
def test_ranks(test_file, n):
    run_pytest_on_ranks(n, test_file)
