"""Horovod's ``hvd.SyncBatchNorm``: hpctrain's SyncBatchNorm over a process set, negotiated."""
from __future__ import annotations

from ...torch.sync_batchnorm import SyncBatchNorm as _Native
from ..basics import global_process_set
from ..negotiated import NegotiatedComm

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_Native):
    """Batch normalisation with statistics over every rank of ``process_set`` (any input rank >= 2).

    Same arguments as ``torch.nn.BatchNorm1d`` plus Horovod's ``process_set``;
    the statistics are those of the concatenated batches of all ranks.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, comm=None, device=device,
                         dtype=dtype)
        self.process_set = process_set

    def forward(self, x):
        """Normalise ``x`` with the statistics of every rank's batch (training) or the running ones."""
        if self.comm is None:
            self.comm = NegotiatedComm(self.process_set)
        return super().forward(x)
