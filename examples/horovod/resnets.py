"""ResNets written in torch.nn (He et al., 2016), so the Horovod-style examples need no torchvision.

``resnet18()``, ``resnet34()``, ``resnet50()`` return ImageNet-shaped models
(3 x H x W input, ``num_classes`` outputs) with the usual layout: a 7x7
stride-2 stem, max-pool, four stages of basic (18/34) or bottleneck (50)
blocks, global average pool and a linear head.  Any input of 32 pixels or
more works.
"""
import torch.nn as nn

__all__ = ["resnet18", "resnet34", "resnet50"]


class Basic(nn.Module):
    """Two 3x3 convolutions with a shortcut."""

    expansion = 1

    def __init__(self, cin, width, stride):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width))
        self.short = _shortcut(cin, width, stride)

    def forward(self, x):
        return (self.body(x) + self.short(x)).relu()


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with a shortcut."""

    expansion = 4

    def __init__(self, cin, width, stride):
        super().__init__()
        out = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out))
        self.short = _shortcut(cin, out, stride)

    def forward(self, x):
        return (self.body(x) + self.short(x)).relu()


def _shortcut(cin, cout, stride):
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """A ResNet of ``block`` with ``depths`` blocks per stage."""

    def __init__(self, block, depths, num_classes=1000):
        super().__init__()
        layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                  nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for stage, depth in enumerate(depths):
            width = 64 * 2 ** stage
            for i in range(depth):
                layers.append(block(cin, width, 2 if i == 0 and stage > 0 else 1))
                cin = width * block.expansion
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def resnet18(num_classes=1000, **_):
    """ResNet-18 (11.7 M parameters at 1000 classes)."""
    return ResNet(Basic, [2, 2, 2, 2], num_classes)


def resnet34(num_classes=1000, **_):
    """ResNet-34."""
    return ResNet(Basic, [3, 4, 6, 3], num_classes)


def resnet50(num_classes=1000, **_):
    """ResNet-50 (25.6 M parameters at 1000 classes)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)
