"""A Horovod-style elastic training script on ``hpctrain.horovod.torch``, for tests/test_horovod_elastic.py.

Written the way Horovod's elastic recipes are (``hvd.elastic.run``, ``hvd.elastic.TorchState`` with an
``ElasticSampler`` and counters, a reset callback that scales the learning rate to the new size, a commit
after every batch), with faults injected for real: ``--exit EPOCH:BATCH:R1,R2`` makes the ranks that *started*
as R1, R2 (``HOROVOD_RANK``) leave at that epoch and batch, by SIGKILL (``--exit-mode kill``) or by raising
(``--exit-mode exception``).  Rank 0 appends one JSON line per finished epoch to ``--log`` (epoch, size, start
rank, how many times ``train`` was entered, the learning rate), and at the end every rank's parameters are
gathered and rank 0 writes whether they are identical.  With ``--hosts-schedule`` (the hosts a discovery
script offers for each epoch, as JSON lists), rank 0 waits at the end of an epoch, as Horovod's judge does,
until the launcher has news of the next epoch's hosts (``state._host_messages``), so the commit that ends
the epoch acts on them.  ``--epoch-pause S`` makes rank 0 wait S seconds before each epoch's batches (and
after each re-forming), so that news of the hosts is acted on within the epoch it was caused in.
"""
import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import hpctrain.horovod.torch as hvd

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--samples", type=int, default=240)
p.add_argument("--exit", default="", help="EPOCH:BATCH:START_RANKS")
p.add_argument("--exit-mode", default="kill", choices=["kill", "exception"])
p.add_argument("--log", required=True)
p.add_argument("--hosts-schedule", default="[]", help="JSON: the hosts offered for epoch 0, 1, ...")
p.add_argument("--epoch-pause", type=float, default=0.0, help="seconds rank 0 waits at the end of each epoch")
args = p.parse_args()

hvd.init()
start_rank = int(os.environ["HOROVOD_RANK"])
exit_at = None
if args.exit:
    epoch, batch, ranks = args.exit.split(":")
    exit_at = (int(epoch), int(batch), {int(r) for r in ranks.split(",")})

torch.manual_seed(0)
x = torch.randn(args.samples, 8)
y = (x.sum(1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
base_lr = 0.01
optimizer = torch.optim.SGD(model.parameters(), lr=base_lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(list(range(args.samples)), shuffle=True, seed=5)


def on_reset():
    for group in optimizer.param_groups:
        group["lr"] = base_lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0, entered=0)
state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    state.entered += 1
    while state.epoch < args.epochs:
        if hvd.rank() == 0:
            time.sleep(args.epoch_pause)     # (before the epoch's batches: news of the hosts comes within it)
        order = list(state.sampler)          # (this rank's share of what the epoch has left, dealt now)
        for b in range(-(-len(order) // args.batch)):
            if exit_at and exit_at[:2] == (state.epoch, state.batch) and start_rank in exit_at[2]:
                if args.exit_mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"start rank {start_rank} leaves at epoch {state.epoch} batch {state.batch}")
            rows = order[b * args.batch:(b + 1) * args.batch]
            optimizer.zero_grad()
            F.cross_entropy(model(x[rows]), y[rows]).backward()
            optimizer.step()
            state.sampler.record_batch(b, len(rows))
            state.batch += 1
            state.commit()
        if hvd.rank() == 0:
            with open(args.log, "a") as f:
                f.write(json.dumps({"epoch": state.epoch, "size": hvd.size(), "start_rank": start_rank,
                                    "entered": state.entered, "lr": optimizer.param_groups[0]["lr"],
                                    "host": os.environ["HOROVOD_HOSTNAME"]}) + "\n")
            schedule = json.loads(args.hosts_schedule)
            if state.epoch + 1 < len(schedule) and schedule[state.epoch] != schedule[state.epoch + 1]:
                state._last_updated_timestamp = 0
                deadline = time.monotonic() + 30
                while state._host_messages.empty():
                    assert time.monotonic() < deadline, "no news of the hosts from the launcher in 30 s"
                    time.sleep(0.05)
        state.epoch += 1
        state.batch = 0
        state.sampler.set_epoch(state.epoch)
        state.commit()


train(state)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
every = hvd.allgather_object(flat.tolist())
if hvd.rank() == 0:
    with open(args.log, "a") as f:
        f.write(json.dumps({"identical": all(e == every[0] for e in every), "ranks": len(every)}) + "\n")
