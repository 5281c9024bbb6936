"""User-side factories for the training tests, named on the command line as
``user_factories:...`` (tests put tests/mpi on PYTHONPATH)."""
import time

import torch
from torch.utils.data import Dataset

from mpidp import data


class SlowDataset(Dataset):
    """A plain map-style dataset (not a TensorDataset) that takes ``delay_s`` per item, as a
    slow data loader would: it keeps a run going long enough to be killed mid-epoch."""

    def __init__(self, base, delay_s):
        self.base, self.delay_s = base, delay_s

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return self.base[i]


def slow_digits():
    train, test = data.digits()
    return SlowDataset(train, 0.0004), test


def tiny_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))


def not_a_model():
    return "a string"
