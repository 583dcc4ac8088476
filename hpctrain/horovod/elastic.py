"""``hvd.elastic``: Horovod's elastic training is not built in hpctrain yet; every name says so."""
from __future__ import annotations


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(f"hvd.elastic.{name}: elastic training is not built in hpctrain yet (it is the "
                              f"next capability); restart from hpctrain's checkpoints instead")
