"""Optimizers over the data-parallel ranks, framework-neutral: ZeRO sharding (:mod:`hpctrain.optim.zero`)."""
