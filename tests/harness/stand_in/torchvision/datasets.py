"""``MNIST`` with torchvision's signature and synthetic, learnable data: each of the ten
classes is a fixed random 28 x 28 pattern, each image its class's pattern plus noise, the
same on every process (seeded), never downloaded. ``STAND_IN_MNIST_SIZES`` ("train,test",
default "2048,512") sets the sizes."""
import os

import numpy as np


class MNIST:
    def __init__(self, root, train=True, download=False, transform=None):
        sizes = [int(s) for s in os.environ.get("STAND_IN_MNIST_SIZES", "2048,512").split(",")]
        count = sizes[0] if train else sizes[1]
        patterns = np.random.default_rng(0).integers(0, 256, (10, 28, 28))
        rng = np.random.default_rng(1 if train else 2)
        self.targets = rng.integers(0, 10, count)
        noise = rng.integers(-64, 65, (count, 28, 28))
        self.data = np.clip(patterns[self.targets] + noise, 0, 255).astype(np.uint8)
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        image = self.data[i]
        return (self.transform(image) if self.transform else image), int(self.targets[i])
