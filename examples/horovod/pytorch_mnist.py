"""A small CNN on handwritten digits in Horovod's style, on hpctrain.horovod (one import changed).

    hpctrain launch -np 2 python examples/horovod/pytorch_mnist.py --epochs 3
    python examples/horovod/pytorch_mnist.py --num-proc 2      # through hpctrain.horovod.run

The data are scikit-learn's bundled 8x8 digits (1797 images, no download),
scaled to 28x28 as MNIST's; 20% are held out for the test.  Each rank trains
on its share (torch's DistributedSampler), gradients are averaged by
``hvd.DistributedOptimizer``, the learning rate scales with the ranks, and
the test metrics are averaged with ``hvd.allreduce``.  Rank 0 prints the
test accuracy, and ``--min-accuracy`` makes the script fail below it.
"""
import argparse
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data.distributed

import hpctrain.horovod as horovod
import hpctrain.horovod.torch as hvd

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--epochs", type=int, default=10)      # (Horovod's recipe: 10)
p.add_argument("--lr", type=float, default=0.02)
p.add_argument("--momentum", type=float, default=0.5)
p.add_argument("--seed", type=int, default=42)
p.add_argument("--fp16-allreduce", action="store_true")
p.add_argument("--use-adasum", action="store_true", help="hvd.allreduce(op=hvd.Adasum) of the test metrics too")
p.add_argument("--gradient-predivide-factor", type=float, default=1.0)
p.add_argument("--min-accuracy", type=float, default=0.0)
p.add_argument("--num-proc", type=int, help="run through hpctrain.horovod.run on this many ranks")


def digits(train: bool):
    """The digits as a TensorDataset of 1x28x28 float images (normalised) and labels; a fixed 80/20 split."""
    from sklearn.datasets import load_digits
    d = load_digits()
    images = d.images.astype(np.float32) / 16.0
    rows = (np.arange(28) * 8 // 28)
    images = images[:, rows][:, :, rows]                     # 8x8 -> 28x28, nearest neighbour
    order = np.random.default_rng(0).permutation(len(images))
    cut = int(0.8 * len(images))
    idx = order[:cut] if train else order[cut:]
    x = torch.from_numpy((images[idx] - 0.1307) / 0.3081).unsqueeze(1)
    return torch.utils.data.TensorDataset(x, torch.from_numpy(d.target[idx]).long())


class Net(nn.Module):
    """Two convolutions and two linear layers (Horovod's MNIST example net)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def main(args):
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_set, test_set = digits(True), digits(False)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_set, num_replicas=hvd.size(),
                                                                    rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_set, num_replicas=hvd.size(),
                                                                   rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=256, sampler=test_sampler)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         gradient_predivide_factor=args.gradient_predivide_factor)
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()
        model.eval()
        loss = correct = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                out = model(data)
                loss += F.nll_loss(out, target, reduction="sum").item()
                correct += (out.argmax(1) == target).sum().item()
        op = hvd.Adasum if args.use_adasum else hvd.Average
        loss = hvd.allreduce(torch.tensor(loss / len(test_sampler)), name="avg_loss", op=op).item()
        accuracy = hvd.allreduce(torch.tensor(correct / len(test_sampler)), name="avg_accuracy", op=op).item()
        if hvd.rank() == 0:
            print(f"epoch {epoch}: test loss {loss:.4f}, accuracy {100 * accuracy:.2f}%", flush=True)
    return accuracy


if __name__ == "__main__":
    args = p.parse_args()
    if args.num_proc:
        accuracies = horovod.run(main, args=(args,), np=args.num_proc)
    else:
        accuracies = [main(args)]
    if min(accuracies) < args.min_accuracy:
        sys.exit(f"test accuracy {min(accuracies):.4f} is below --min-accuracy {args.min_accuracy}")
