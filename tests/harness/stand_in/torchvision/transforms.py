"""``Compose``, ``ToTensor`` and ``Normalize`` for the stand-in MNIST's uint8 images."""
import torch


class Compose:
    def __init__(self, steps):
        self.steps = list(steps)

    def __call__(self, x):
        for step in self.steps:
            x = step(x)
        return x


class ToTensor:
    """An H x W uint8 array to a 1 x H x W float tensor in [0, 1], as torchvision's does."""

    def __call__(self, image):
        return torch.as_tensor(image, dtype=torch.float32).unsqueeze(0) / 255


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std
