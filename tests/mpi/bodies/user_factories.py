"""User-side factories for the training tests, named on the command line as
``user_factories:...`` (tests put tests/mpi/bodies on PYTHONPATH), and the faults the fault matrix
injects through them (tests/mpi/test_faults.py): FAULT names the fault, FAULT_RANK the rank
that suffers it, FAULT_AT when (an item, a step or a push; see each factory)."""
import os
import signal
import time

import torch
from torch.utils.data import Dataset

import mpidp
from mpidp.workloads import data


class SlowDataset(Dataset):
    """A plain map-style dataset (not a TensorDataset) that takes ``delay_s`` per item, as a
    slow data loader would: it keeps a run going long enough to be killed mid-epoch."""

    num_classes = 10  # so that nothing reads every (slow) label to count the classes

    def __init__(self, base, delay_s):
        self.base, self.delay_s = base, delay_s

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.base[i]


def _rank_here():
    """This process's rank as its launcher (Hydra, Open MPI) says it, before mpidp.init; None
    outside one."""
    return os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))


def _fault_here(rank_var="FAULT_RANK"):
    """Whether this process is the rank named by ``rank_var`` (read before mpidp.init)."""
    here = _rank_here()
    return here is not None and here == os.environ.get(rank_var)


def inject(kind, once=None):
    """The fault ``kind`` happens now: raise, sleep (a stall: FAULT_SLEEP_S, default 600 s),
    stop (SIGSTOP: the process neither runs nor dies), kill (SIGKILL of this process, its
    pid first written to FAULT_PID_FILE and the time to FAULT_TIME_FILE if set) or usr1
    (SIGUSR1 to this process alone, as a signal that reaches one rank before the others) or
    lost_int (Ctrl-C to this process alone, its KeyboardInterrupt caught and dropped, as a
    library's bare ``except`` or Python's "Exception ignored" would: Note [A lost interrupt]
    in mpidp/train/interrupts.py).
    With FAULT_ONCE_FILE set, only where that file does not exist yet, which the fault
    creates: a job the supervisor relaunches (python -m mpidp.run) meets it once; ``once``, a
    path of its own instead."""
    once = once or os.environ.get("FAULT_ONCE_FILE")
    if once:
        try:
            open(once, "x").close()
        except FileExistsError:
            return
    if kind == "raise":
        raise RuntimeError("injected fault: this rank's data loader failed")
    if kind == "usr1":
        os.kill(os.getpid(), signal.SIGUSR1)
    elif kind == "lost_int":
        try:
            signal.raise_signal(signal.SIGINT)  # its handler runs before this returns
        except KeyboardInterrupt:
            pass
    elif kind == "sleep":
        time.sleep(float(os.environ.get("FAULT_SLEEP_S", "600")))
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "kill":
        if os.environ.get("FAULT_PID_FILE"):
            with open(os.environ["FAULT_PID_FILE"], "w") as f:
                f.write(str(os.getpid()))
        if os.environ.get("FAULT_TIME_FILE"):  # when, for the recovery bench's detection
            with open(os.environ["FAULT_TIME_FILE"], "a") as f:
                f.write(f"{time.time()!r}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise ValueError(f"unknown FAULT {kind!r}")


class FaultyDataset(SlowDataset):
    """Injects fault ``kind`` (``inject``) when this rank fetches its ``at``-th item: a fault
    at a known step, anywhere in an epoch (the first item is read once at start-up)."""

    def __init__(self, base, kind=None, at=-1):
        super().__init__(base, 0.0)
        self.fetched, self.kind, self.at, self.once = 0, kind, at, None

    def __getitem__(self, i):
        self.fetched += 1
        if self.fetched == self.at:
            inject(self.kind, self.once)
        return self.base[i]


class DyingDataset(FaultyDataset):
    """Kills its own process with SIGKILL when this rank (``DIE_RANK``) fetches its
    ``DIE_AT_ITEM``-th item: a crash at a known step, anywhere in an epoch. Lists (DIE_RANK=1,0
    DIE_AT_ITEM=300,700): each rank named dies at its own item, once each where
    FAULT_ONCE_FILE is set (that path, "-" and the rank): failures one after another."""

    def __init__(self, base):
        here = _rank_here()
        ranks = os.environ.get("DIE_RANK", "").split(",")
        items = os.environ.get("DIE_AT_ITEM", "-1").split(",")
        super().__init__(base, "kill", int(items[ranks.index(here)]) if here in ranks else -1)
        if len(ranks) > 1 and os.environ.get("FAULT_ONCE_FILE"):
            self.once = f"{os.environ['FAULT_ONCE_FILE']}-{here}"


def dying_digits():
    train, test = data.digits()
    return DyingDataset(train), test


def dying_in_eval_digits():
    """The digits, and DyingDataset around the held-out set: DIE_RANK dies at its
    DIE_AT_ITEM-th held-out item, in an epoch's end (its score), its steps all done."""
    train, test = data.digits()
    return train, DyingDataset(test)


def _replacement_started(timeout_s=60.0):
    """Returns once a process of this test's job (its MPIDP_TEST_TAG) runs as a replacement
    (``-X mpidp-replaces`` on its command line, mpidp.runtime.recovery.REPLACEMENT), or after
    ``timeout_s``."""
    from pathlib import Path
    from mpidp.runtime.recovery import REPLACEMENT
    tag = f"MPIDP_TEST_TAG={os.environ.get('MPIDP_TEST_TAG', '')}".encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and REPLACEMENT.encode() in \
                        (entry / "cmdline").read_bytes().split(b"\0") and \
                        tag in (entry / "environ").read_bytes().split(b"\0"):
                    return
            except OSError:
                continue
        time.sleep(0.05)


def dying_in_respawn_digits():
    """dying_digits, and the rank DIE_IN_RESPAWN (a survivor) killed (SIGKILL) as it enters
    the respawn of the lost one (mpidp.runtime.recovery.respawn), once (FAULT_ONCE_FILE and
    "-respawn"), once the replacement's process has started (the others inside
    MPI_Comm_spawn by then): a failure during the respawn."""
    if _rank_here() == os.environ.get("DIE_IN_RESPAWN"):
        from mpidp.runtime import recovery
        respawn = recovery.respawn

        def dying(*args, **kwargs):
            _replacement_started()
            inject("kill", once=f"{os.environ['FAULT_ONCE_FILE']}-respawn")
            return respawn(*args, **kwargs)
        recovery.respawn = dying
    return dying_digits()


def dying_in_allreduce_digits():
    """The digits, and the rank DIE_RANK killed (SIGKILL) inside its DIE_AT_CALL-th ring
    all-reduce of more than 16 KiB (a bucket of the step's gradients, not a scalar), between
    its reduce-scatter and its all-gather (mpidp.engine.ring): its ring neighbours are in the
    middle of the collective, their gradients half reduced. Once (FAULT_ONCE_FILE)."""
    if _rank_here() == os.environ.get("DIE_RANK"):
        from mpidp.engine import ring
        allgather, at, calls = ring.allgather_phase, int(os.environ["DIE_AT_CALL"]), [0]

        def dying(buf, transport, chunks):
            if buf.nbytes > 16 << 10:
                calls[0] += 1
                if calls[0] == at:
                    inject("kill")
            return allgather(buf, transport, chunks)
        ring.allgather_phase = dying
    return data.digits()


def slowly_written_digits():
    """dying_digits, and on rank 0 the checkpoint of global step SLOW_WRITE_AT (if set) stays
    half written for 60 s (its bytes written, before the rename): a fault then comes while it
    is being written (the async kill test)."""
    at = os.environ.get("SLOW_WRITE_AT")
    if at is not None:
        from mpidp.train import checkpoint
        write = checkpoint._write_archive

        def slow(f, state):
            digest = write(f, state)
            if state.get("global_step") == int(at):
                f.flush()
                time.sleep(60)
            return digest
        checkpoint._write_archive = slow
    return dying_digits()


def slow_digits():
    """The digits, each training item taking SLOW_S seconds (default 1 ms, ~32 ms a step): a
    run long enough to be signalled mid-run, with the digits' numbers."""
    train, test = data.digits()
    return SlowDataset(train, float(os.environ.get("SLOW_S", "0.001"))), test


def faulty_digits():
    """The digits with FAULT (raise, sleep, kill) on FAULT_RANK at its FAULT_AT-th item."""
    train, test = data.digits()
    at = int(os.environ.get("FAULT_AT", "-1")) if _fault_here() else -1
    return FaultyDataset(train, os.environ.get("FAULT"), at), test


class RecordingDataset(Dataset):
    """Appends each index it is asked for to SAMPLE_LOG_DIR/<pid>.txt, one per line (the
    first is the item read once at start-up for the input shape)."""

    num_classes = 10  # so nothing reads every label to count them

    def __init__(self, base):
        self.base = base
        self.log = open(os.path.join(os.environ["SAMPLE_LOG_DIR"], f"{os.getpid()}.txt"), "a")

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        self.log.write(f"{int(i)}\n")
        self.log.flush()
        return self.base[i]


def recorded_digits():
    """46 digits, each sample index a rank trains on recorded (RecordingDataset)."""
    train, test = data.digits()
    return RecordingDataset(torch.utils.data.Subset(train, range(46))), test


class SyncMean(torch.nn.Module):
    """Subtracts the mean of the features over every rank's batch, all-reduced in forward
    (as SyncBatchNorm's statistics are). At FAULT_RANK's FAULT_AT-th training forward,
    FAULT=shape all-reduces one feature fewer and FAULT=skip skips the all-reduce."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.fault = os.environ.get("FAULT") if _fault_here() else None
        self.at = int(os.environ.get("FAULT_AT", "-1"))

    def forward(self, x):
        if not self.training:
            return x
        self.calls += 1
        mean = x.detach().mean(0)
        if self.calls == self.at and self.fault == "skip":
            return x
        if self.calls == self.at and self.fault == "shape":
            mean = mean[:-1]
        return x - mpidp.allreduce(mean, op="avg")


def sync_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16), SyncMean(),
                               torch.nn.ReLU(), torch.nn.Linear(16, 10))


def batchnorm_model():
    """An MLP for the digits with a BatchNorm layer (buffers that each rank updates)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32),
                               torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 10))


class _RankBranch(torch.nn.Module):
    """A branch only rank 0 takes (data-dependent routing, in miniature)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.branch = torch.nn.Linear(64, 10), torch.nn.Linear(64, 10)

    def forward(self, x):
        x = x.flatten(1)
        return self.body(x) + (self.branch(x) if mpidp.rank() == 0 else 0)


def rank_branch_model():
    return _RankBranch()


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


def ps_faulty_digits():
    """The digits, with a parameter-server fault on FAULT_RANK in its epoch FAULT_EPOCH
    (counted from 0; default 1, so that the first epoch's checkpoint exists), FAULT_AT
    counting within that epoch. FAULT=kill_push: a worker dies inside its FAULT_AT-th push,
    after adding its gradient on the server and before counting the push, holding a lock on
    the server's window (with the shards in shared memory: its slot written, not announced;
    Note [Node-local shards]); FAULT=stop_push: it stops there instead (SIGSTOP: a death the
    launcher does not see); FAULT=sleep_push: it stalls before that push; FAULT=kill_server:
    the server dies in its FAULT_AT-th optimizer step (pushes drained, not yet published)."""
    if _fault_here():
        _arm_ps_fault(os.environ.get("FAULT"), int(os.environ.get("FAULT_AT", "-1")),
                      int(os.environ.get("FAULT_EPOCH", "1")))
    # only the server builds an optimizer, and the first one imports torch._dynamo (seconds):
    # every rank builds one here, so that the ranks reach their first collectives together
    # and the short MPIDP_TIMEOUT_S of the tests sees no start-up skew
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return data.digits()


def _arm_ps_fault(kind, at, epoch):
    from mpidp.modes import ps
    from mpidp.modes import ps_server, ps_shared
    from mpidp.runtime import windows
    state = {"epoch": 0, "pushing": False}
    finish, push, serve = ps.Worker.finish_epoch, ps.Worker.push, ps_server.Server.serve_epoch
    accumulate, announce = windows.Window.accumulate, ps_shared.SharedShards.announce

    def due(count):  # the count-th event (1-based) of this epoch is the fault's
        return state["epoch"] == epoch and count == at

    def finish_epoch(self):
        finish(self)
        state["epoch"] += 1

    def faulty_push(self, grad, *args):
        if kind == "sleep_push" and due(self.steps + 1):
            inject("sleep")
        state["pushing"] = kind in ("kill_push", "stop_push") and due(self.steps + 1)
        push(self, grad, *args)

    def faulty_accumulate(self, *args, **kwargs):
        accumulate(self, *args, **kwargs)
        if state["pushing"]:
            inject(kind.split("_")[0])

    def faulty_announce(self, *args):
        if state["pushing"]:
            inject(kind.split("_")[0])
        announce(self, *args)

    def serve_epoch(self, apply):
        applies = [0]

        def faulty_apply(params, grads, n):
            applies[0] += 1
            if kind == "kill_server" and due(applies[0]):
                inject("kill")
            apply(params, grads, n)
        serve(self, faulty_apply)
        state["epoch"] += 1

    ps.Worker.finish_epoch, ps.Worker.push = finish_epoch, faulty_push
    ps_server.Server.serve_epoch = serve_epoch
    windows.Window.accumulate = faulty_accumulate
    ps_shared.SharedShards.announce = faulty_announce
