"""Run pytest on one rank of a launch, with this rank's output in its own log file.

Usage (by harness.py): ``mpirun -n N python tests/rank_main.py LOGDIR pytest-args...``.
Output is redirected at the file-descriptor level, so tracebacks printed while
the job aborts land in the rank's log too; per-test events go to
``LOGDIR/rank<r>.jsonl`` (see rank_report.py).
"""
import os
import sys

from hpctrain.env import detect_launcher


def main():
    logdir, args = sys.argv[1], sys.argv[2:]
    launch = detect_launcher()
    rank = launch.rank if launch else 0
    fd = os.open(os.path.join(logdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import pytest
    from rank_report import RankReport

    sys.exit(pytest.main(args, plugins=[RankReport(os.path.join(logdir, f"rank{rank}.jsonl"))]))


if __name__ == "__main__":
    main()
