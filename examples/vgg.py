"""VGG-11 (Simonyan and Zisserman 2015) written out, since torchvision does not install beside torch
2.13 here: a user's own CNN for ``shardplan plan --module``.

    PYTHONPATH=examples shardplan plan --module vgg:build --input-shape 2,3,224,224 --devices 8 --verify

With 2 images of 224 x 224 on 8 DGX-A100 GPUs the exact search splits the first convolutions by
batch and columns, the later ones by channels, and the classifier's linears by their features
(OptCNN's kind of plan); ``--verify`` applies the plan with DTensor and steps it on a fake process
group of 8 ranks.
"""

from torch import nn

CONFIG = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
"""Output channels of each 3x3 convolution (ReLU after each), "M" a 2x2 max pool: VGG's configuration A."""


def build(classes: int = 1000) -> nn.Module:
    layers, channels = [], 3
    for v in CONFIG:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU()]
            channels = v
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(),
                         nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, classes))
