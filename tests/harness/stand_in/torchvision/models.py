"""Models by name as ``torchvision.models`` offers them (``getattr(models, name)()``), small
enough to train on a CPU in seconds: ImageNet-shaped in (3 x 224 x 224), 1000 classes out."""
from torch import nn


def small_cnn(num_classes: int = 1000) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, kernel_size=7, stride=4), nn.ReLU(),
                         nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, num_classes))
