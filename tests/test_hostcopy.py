"""HostCopier (the snapshot copy of an asynchronous checkpoint) copies every byte, with any thread count."""
import numpy as np
import pytest

from hpctrain.checkpoint.hostcopy import MIN_CHUNK, HostCopier, default_copy_threads


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copies_equal_their_sources_for_every_layout(threads):
    rng = np.random.default_rng(threads)
    srcs = [rng.standard_normal(3 * MIN_CHUNK // 8 + 5),                         # split in chunks, odd tail
            rng.integers(0, 255, (1000, 777), dtype=np.uint8),                   # small: copied whole
            rng.standard_normal((4096, 2048)).astype(np.float32)[:, ::2],        # not contiguous: whole
            np.array(3.5),                                                       # 0-d
            rng.standard_normal(MIN_CHUNK).astype(np.float16),
            np.zeros(0, dtype=np.int64)]
    dsts = [np.full(s.shape, 7, dtype=s.dtype) for s in srcs]
    copier = HostCopier(threads)
    copier.copy(list(zip(dsts, srcs)))
    copier.copy(list(zip(dsts, srcs)))    # the pool is reused
    copier.close()
    for d, s in zip(dsts, srcs):
        assert d.dtype == s.dtype and np.array_equal(d, s)


def test_bad_thread_counts_are_refused_and_the_default_is_this_ranks_share():
    with pytest.raises(ValueError, match="positive int"):
        HostCopier(0)
    assert 1 <= default_copy_threads(1) <= 8
    assert default_copy_threads(10 ** 6) == 1
