"""A stand-in for the few names of torchvision that Horovod's PyTorch examples import, for
machines without torchvision or a download: a synthetic MNIST, the transforms it needs, and
small models a CPU trains in seconds. Only the example tests put this folder on PYTHONPATH
(tests/mpi/test_horovod_examples.py); nothing of mpidp imports it."""
from . import datasets, models, transforms  # noqa: F401
