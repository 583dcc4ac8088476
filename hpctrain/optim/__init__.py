"""Optimizers over the data-parallel ranks, framework-neutral: ZeRO sharding (:mod:`hpctrain.optim.zero`), local
SGD and DiLoCo (:mod:`hpctrain.optim.local_sgd`)."""
