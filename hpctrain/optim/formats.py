"""The marks of optimizer states spread over the ranks, as a checkpoint or an elastic commit records them.

An optimizer wrapper whose state is not alike on every rank writes it as a common
part plus each rank's own (``shard_state_dict``); the common part's ``"format"``
says which restore rule applies (``load_shard_state_dict``, or
:func:`hpctrain.checkpoint.state.load_spread` for another target).
"""

__all__ = ["SHARDS_FORMAT", "LOCAL_SGD_FORMAT", "RANK_STATES_FORMAT"]

SHARDS_FORMAT = "hpctrain-zero/1"               # ZeRO: each rank's chunks (hpctrain.optim.zero)
LOCAL_SGD_FORMAT = "hpctrain-local-sgd/1"       # local SGD / DiLoCo (hpctrain.optim.local_sgd)
RANK_STATES_FORMAT = "hpctrain-rank-states/1"   # each rank's own optimizer state (op='adasum')
