"""``import horovod.torch as hvd`` gives ``mpidp.horovod``: this module replaces itself in
``sys.modules`` (the shim of tests/harness/horovod_suite.py)."""
import sys

import mpidp.horovod

sys.modules[__name__] = mpidp.horovod
