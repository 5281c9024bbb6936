"""User-side factories for the training tests, named on the command line as
``user_factories:...`` (tests put tests/mpi on PYTHONPATH)."""
import os
import signal
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


class DyingDataset(SlowDataset):
    """Kills its own process with SIGKILL when this rank (``DIE_RANK``) fetches its
    ``DIE_AT_ITEM``-th item: a crash at a known step, anywhere in an epoch."""

    num_classes = 10  # so that nothing reads every label to count the classes

    def __init__(self, base):
        super().__init__(base, 0.0)
        self.fetched = 0
        here = os.environ.get("PMI_RANK")
        self.die_at = int(os.environ.get("DIE_AT_ITEM", "-1")) \
            if here is not None and here == os.environ.get("DIE_RANK") else -1

    def __getitem__(self, i):
        self.fetched += 1
        if self.fetched == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.base[i]


def dying_digits():
    train, test = data.digits()
    return DyingDataset(train), test


def tiny_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))


def not_a_model():
    return "a string"


def empty_test():
    train, _ = data.digits()
    return train, torch.utils.data.TensorDataset(torch.zeros(0, 64), torch.zeros(0))


def not_a_dataset():
    return 42, None


def broken():
    raise OSError("the data files are missing")
