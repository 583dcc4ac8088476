"""Elastic training: a failed rank or node costs seconds, not the job.

Start the job with ``hpctrain launch --elastic --min-np A -n N train.py``
(Open MPI's fault-tolerance extension, ULFM, keeps the survivors running),
keep the training state in a :class:`State` and commit it every few steps,
and wrap the training function with :func:`run`::

    state = hpctrain.torch.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hpctrain.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch in loader:            # (sampler=state.sampler)
                ...step...
                state.sampler.record_batch(batch_size)
                state.commit()
            state.epoch += 1            # (a commit at the epoch's end names the next epoch)
            state.sampler.set_epoch(state.epoch)
            state.commit()

When ranks die, every survivor's collective raises WorldFailedError within
about a second; :func:`run` re-forms the world from the survivors
(:mod:`hpctrain.elastic.reform`), every survivor goes back to the newest
commit they all kept (:mod:`hpctrain.elastic.state`), the sampler re-deals
the epoch's unseen samples over the new size (:mod:`hpctrain.elastic.sampler`),
and training goes on.  What holds the world communicator follows it:
``hpctrain.torch.DistributedOptimizer`` (made without ``comm=``) rebuilds its
buckets on the new world (:func:`hpctrain.world.on_reform`).  When a host
discovery script offers more slots (and ``HPCTRAIN_ELASTIC_GROW=spawn``), the
world grows in place at a commit: new
ranks are spawned on the added hosts and merged in (:mod:`hpctrain.elastic.grow`);
their program runs from the top (:func:`joining` is True there until
:func:`run` merges them) and the running ranks hand them the state.
"""
from ..errors import WorldFailedError
from ..world import generation, on_reform
from .grow import joining
from .reform import Reformed, WorldTooSmallError, reform
from .run import run
from .sampler import ElasticSampler
from .state import ObjectState, State

__all__ = ["run", "reform", "generation", "on_reform", "joining", "Reformed", "State", "ObjectState", "ElasticSampler",
           "WorldFailedError", "WorldTooSmallError"]
