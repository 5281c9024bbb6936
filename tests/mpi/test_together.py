"""Tier 2: the bodies that pass at any world size, at n = 1 (their size-1 paths: the
collectives' and the backend's shortcuts, DDP's, ZeRO's, Join's, the audit's), n = 2 and n = 3
(3 ranks on 2 cores), each size in one launch: tests/mpi/bodies/body_together.py runs them one
after another in one process per rank, each as it runs alone, for the price of one start-up
(mpiexec, and an import of torch on every rank: seconds each on two busy cores; the ten at
n = 3 took 98 s launched one by one, 32 s together). A body that fails is named in the output
(``body_together: <name> failed``). What they check: the collectives (body_collectives.py),
mpidp's DistributedDataParallel and the fused helpers (body_ddp.py), every collective of the
torch.distributed backend with torch's DDP, ZeRO and checkpoint on it (body_dist.py),
SyncBatchNorm (body_syncbn.py), uneven inputs under torch's Join (body_join.py), torchmetrics
(body_metrics.py), torch's communication hooks on mpidp's DDP against torch's DDP on gloo
(body_hooks.py), the replica audit (body_audit.py), mpidp's compression hooks (body_compression.py),
ZeRO against the unsharded optimizer (body_zero.py), a script written for Horovod on
mpidp.horovod (body_horovod.py) and its hvd.join (body_horovod_join.py), which thread runs the
backend's calls
(body_dist_calls.py), and from n = 2 no silent wrong answer for bad input on some ranks
(body_bad_inputs.py). body_runtime.py, which must start before anything imports MPI, runs
alone at every n (test_runtime.py)."""
import pytest

from mpirun import assert_ok, body, together

TOGETHER = ("body_collectives.py", "body_ddp.py", "body_dist.py", "body_syncbn.py",
            "body_join.py", "body_metrics.py", "body_hooks.py", "body_audit.py",
            "body_compression.py", "body_zero.py", "body_horovod.py", "body_horovod_join.py",
            "body_dist_calls.py")


BEYOND_ONE = ("body_bad_inputs.py",)  # bad inputs on some ranks need others to disagree with


# at n = 3 the shm protocol's chunks are small (Note [Chunk size] in csrc/shm.c: 256 KiB by
# default, larger than most of the bodies' slices): its chunk loop, the spare chunk of rank
# order and segments split across chunks run there
CHUNKS = {3: {"MPIDP_SHM_CHUNK_BYTES": "4096"}}


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_body_together(n):
    together(n, TOGETHER + (BEYOND_ONE if n > 1 else ()),
             env={"MASTER_ADDR": None, "MASTER_PORT": None, **CHUNKS.get(n, {})})


def test_hvd_join_in_debug_mode_through_the_staging_window():
    """Note [Joined ranks] where every header carries its call site (a joined rank's zeros
    carry the others') and ranks may not read each other's memory."""
    assert_ok(body(2, "body_horovod_join.py", env={"MPIDP_DEBUG": "1",
                                                   "MPIDP_SHM_PEERS": "window"}), 2)
