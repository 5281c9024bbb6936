"""A stand-in for the ``horovod`` package, so that Horovod's own test suite
(``test/parallel/test_torch.py``, run by tests/harness/horovod_suite.py) imports
``horovod.torch`` and gets ``mpidp.horovod``. Nothing of Horovod's is here."""
