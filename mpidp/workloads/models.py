"""Built-in models for the training tool and the benchmarks: ``mlp`` and ``cnn``."""
from __future__ import annotations

import math
from typing import Sequence

from torch import nn


def mlp(in_features: int = 784, hidden: Sequence[int] = (256, 256),
        classes: int = 10) -> nn.Module:
    """A ReLU multi-layer perceptron, by default 784-256-256-10 (flattens its input)."""
    layers: list = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def cnn(channels: int = 3, size: int = 32, classes: int = 10, width: int = 32) -> nn.Module:
    """A small CNN for ``channels``×``size``×``size`` images: two 3×3 conv-ReLU-pool stages
    (``width`` and 2·``width`` channels), then a 128-unit hidden layer."""
    if size % 4:
        raise ValueError(f"size must be a multiple of 4 (two 2×2 poolings), got {size}")
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * (size // 4) ** 2, 128), nn.ReLU(),
        nn.Linear(128, classes))


BUILTIN = {"mlp": mlp, "cnn": cnn}


def build(name: str, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """The built-in model ``name`` sized for inputs of ``input_shape`` (one sample) and
    ``num_classes`` classes; ValueError when the model cannot take such inputs."""
    if name == "mlp":
        return mlp(in_features=math.prod(input_shape), classes=num_classes)
    if name == "cnn":
        if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
            raise ValueError(f"model 'cnn' takes square channels x size x size images, the data "
                             f"set gives {'x'.join(map(str, input_shape))}")
        return cnn(channels=input_shape[0], size=input_shape[1], classes=num_classes)
    raise ValueError(f"unknown model {name!r}; built-in: {', '.join(BUILTIN)}, or "
                     "package.module:factory")
