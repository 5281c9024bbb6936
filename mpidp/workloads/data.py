"""Training data: the built-in data sets (``digits`` shipped in the package, ``synthetic`` of any
size), user factories named ``package.module:factory``, and the per-rank shard of each epoch
(DistributedSampler semantics)."""
from __future__ import annotations

import functools
import importlib
import math
from importlib import resources
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

DIGITS_TEST_FRACTION = 0.2   # held out from the 1797 digits, the same split on every run
DIGITS_SPLIT_SEED = 20260101  # fixed: the held-out set must not depend on --seed
SYNTHETIC_SHAPE = (1, 28, 28)  # MNIST-shaped, so the built-in mlp and cnn both fit
SYNTHETIC_CLASSES = 10


class DataSets:
    """A train and a held-out set (the held-out one may be None), with what a built-in model
    needs to know of them: the shape of one input and the number of classes (counted on
    first use, which reads every label of a dataset that does not say)."""

    def __init__(self, train: Dataset, test: Optional[Dataset], input_shape: tuple):
        self.train, self.test, self.input_shape = train, test, input_shape

    @functools.cached_property
    def num_classes(self) -> int:
        return _num_classes(self.train, self.test)


def digits() -> tuple:
    """The 8×8 handwritten digits of UCI's "Optical Recognition of Handwritten Digits" (test
    part, 1797 images, CC BY 4.0, shipped in mpidp/assets), pixels scaled to [0, 1]: returns
    (train, test) TensorDatasets of (1×8×8 float32 image, int64 label), 80/20 split."""
    with resources.files("mpidp").joinpath("assets/digits.npz").open("rb") as f:
        raw = np.load(f)
        images, labels = raw["images"], raw["labels"]
    x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(y)))
    cut = len(y) - int(len(y) * DIGITS_TEST_FRACTION)
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]],
                                                                         y[order[cut:]])


def synthetic(samples: int = 8192, seed: int = 0) -> tuple:
    """A learnable MNIST-shaped classification set of ``samples`` training images (and
    ``samples // 8`` held out): Gaussian inputs labelled by a fixed random linear teacher."""
    gen = torch.Generator().manual_seed(seed)
    features = math.prod(SYNTHETIC_SHAPE)
    teacher = torch.randn(features, SYNTHETIC_CLASSES, generator=gen)
    held_out = max(samples // 8, 1)
    x = torch.randn(samples + held_out, *SYNTHETIC_SHAPE, generator=gen)
    y = (x.reshape(len(x), -1) @ teacher).argmax(1)
    return TensorDataset(x[:samples], y[:samples]), TensorDataset(x[samples:], y[samples:])


BUILTIN = ("digits", "synthetic")


def import_factory(spec: str, what: str) -> Callable:
    """The callable named by ``package.module:name``; ValueError saying why it cannot be had."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r}: expected a built-in name or package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module failing as it runs
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r}: "
                         f"{type(exc).__name__}: {exc}") from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}")
    if not callable(obj):
        raise ValueError(f"{what} {spec!r}: {attr!r} is not callable")
    return obj


def call_factory(spec: str, what: str):
    """Imports and calls the factory ``spec`` with no arguments; whatever it raises becomes a
    ValueError naming it."""
    factory = import_factory(spec, what)
    try:
        return factory()
    except Exception as exc:
        raise ValueError(f"{what} {spec!r}: the factory raised {type(exc).__name__}: {exc}") \
            from None


def load(spec: str, synthetic_samples: int = 8192) -> DataSets:
    """The data set named by ``spec``: a built-in (digits, synthetic) or ``package.module:
    factory``, a callable returning (train, test) map-style datasets of (input, label) pairs
    (test may be None). ValueError naming the problem otherwise."""
    if spec == "digits":
        train, test = digits()
    elif spec == "synthetic":
        train, test = synthetic(synthetic_samples)
    else:
        result = call_factory(spec, "dataset")
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ValueError(f"dataset {spec!r}: the factory must return (train, test), got "
                             f"{type(result).__name__}")
        train, test = result
    for name, ds in (("train", train), ("test", test)):
        if ds is None and name == "test":
            continue
        if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
            raise ValueError(f"dataset {spec!r}: {name} set is not a map-style dataset "
                             f"(needs __len__ and __getitem__), got {type(ds).__name__}")
        if len(ds) == 0:
            raise ValueError(f"dataset {spec!r}: the {name} set is empty")
    try:
        x0 = torch.as_tensor(train[0][0])
    except Exception as exc:
        raise ValueError(f"dataset {spec!r}: train[0] is not an (input, label) pair of tensors "
                         f"or numbers ({type(exc).__name__}: {exc})") from None
    return DataSets(train, test, tuple(x0.shape))


def _num_classes(train: Dataset, test: Optional[Dataset]) -> int:
    """``num_classes``/``classes`` of the dataset when it has them, else 1 + the largest label."""
    for ds in (train, test):
        if isinstance(getattr(ds, "num_classes", None), int):
            return ds.num_classes
        if isinstance(getattr(ds, "classes", None), (list, tuple)):
            return len(ds.classes)
    largest = 0
    for ds in (train, test):
        if ds is None:
            continue
        if isinstance(ds, TensorDataset):
            largest = max(largest, int(ds.tensors[1].max()))
        else:
            largest = max(largest, max(int(ds[i][1]) for i in range(len(ds))))
    return largest + 1


class ShardSampler:
    """This rank's indices of each epoch, as torch's DistributedSampler: the dataset is
    permuted from (``seed``, epoch) — the same permutation on every rank — padded by wrapping
    around to a multiple of ``size`` so every rank gets ``len(self)`` indices (and so takes the
    same number of steps), then rank r takes positions r, r+size, r+2·size, ...
    ``shuffle=False`` keeps dataset order; ``pad=False`` (evaluation) gives each sample to
    exactly one rank, so ranks may differ by one."""

    def __init__(self, length: int, rank: int, size: int, seed: int = 0, shuffle: bool = True,
                 pad: bool = True):
        if length < 1:
            raise ValueError(f"cannot shard an empty dataset over {size} ranks")
        if pad and length < size:
            raise ValueError(f"{size} ranks but only {length} training samples: every rank "
                             "needs at least one")
        self.length, self.rank, self.size = length, rank, size
        self.seed, self.shuffle, self.pad = seed, shuffle, pad

    def __len__(self) -> int:
        if self.pad:
            return -(-self.length // self.size)
        return len(range(self.rank, self.length, self.size))

    def indices(self, epoch: int, cursor: int = 0) -> np.ndarray:
        """This rank's sample indices for ``epoch``, in the order they are visited, from
        position ``cursor`` of the epoch's permutation on (Note [Sample cursor])."""
        if not 0 <= cursor < self.length:
            raise ValueError(f"sample cursor {cursor} outside an epoch of {self.length}")
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.length)
        else:
            order = np.arange(self.length)
        if self.pad:
            total = cursor + -(-(self.length - cursor) // self.size) * self.size
            order = np.resize(order, total)  # wraps around, as DistributedSampler pads
        return order[cursor + self.rank::self.size]

    def cursor_after(self, cursor: int, batches: int, batch_size: int) -> int:
        """The epoch's cursor once every rank has taken ``batches`` full batches of
        ``batch_size`` from ``cursor`` (Note [Sample cursor])."""
        return cursor + batches * batch_size * self.size


# Note [Sample cursor]
# Rank r of n takes positions r, r+n, r+2n, ... of the epoch's permutation, in batches of B.
# So once every rank has taken s full batches, the samples consumed are exactly the first
# c = n*s*B positions: the cursor. What is left of the epoch is the permutation from c on,
# shared out the same way over however many ranks continue (padded, as at an epoch's start, by
# wrapping around to the permutation's start). On as many ranks the shares are exactly the
# batches an uninterrupted run would have taken (the same positions, the same padding), so a
# resume stays bit-exact; on m ranks every sample of the epoch is still taken exactly once
# (padding apart). Checkpoints record the cursor (data_order["cursor"]); a resume on another
# number of ranks continues from it.


def batches(dataset: Dataset, indices: Sequence[int], batch_size: int,
            start: int = 0) -> Iterator[tuple]:
    """(inputs, labels) batches of ``dataset`` at ``indices``, ``batch_size`` at a time, the
    last one possibly smaller, beginning with batch number ``start``. TensorDatasets are
    indexed in one gather per tensor; other datasets item by item."""
    for lo in range(start * batch_size, len(indices), batch_size):
        chunk = indices[lo:lo + batch_size]
        if isinstance(dataset, TensorDataset):
            idx = torch.from_numpy(np.asarray(chunk, dtype=np.int64))
            yield tuple(t[idx] for t in dataset.tensors[:2])
        else:
            items = [dataset[int(i)] for i in chunk]
            yield (torch.stack([torch.as_tensor(x) for x, _ in items]),
                   torch.as_tensor([int(y) for _, y in items]))


def describe(spec: str, sets: DataSets) -> str:
    held = f", {len(sets.test)} held out" if sets.test is not None else ""
    classes = f", {sets.num_classes} classes" if "num_classes" in vars(sets) else ""
    return (f"{spec}: {len(sets.train)} training samples{held}, input "
            f"{'x'.join(map(str, sets.input_shape))}{classes}")

