"""Run under mpiexec with BODY_SERVERS servers (1 or 2): the parameter server, its shards in
MPI windows and in the node's shared memory (Note [Node-local shards]; across nodes "mixed":
a node's own pairs in its memory, the rest in windows), every section for both. 1. racing pushes of known integer vectors: the servers end with exactly
their sum, every push applied once; 2. SSP: with staleness S no worker starts a step more
than S ahead of the slowest (checked from recorded clocks); 3. S=0 with one worker equals
plain SGD, bit for bit; 4. no pull sees a half-published shard and no drain a half-written
push (every published shard and every push is one value repeated, over 2 MiB, several pulls to a push). Prints
'ok <rank>'."""
import os
import time

import numpy as np
import torch

import mpidp
from mpidp.modes.ps import ParameterServer, Worker
from mpidp.modes.ps_server import Server

g = mpidp.init()
comm = g.comm
K = int(os.environ.get("BODY_SERVERS", "1"))
counts = [5, 1, 7, 3, 11]  # odd sizes; 27 elements
total = sum(counts)
failures = []


def expect(cond, what):
    if not cond:
        failures.append(what)


def run_epochs(ps, epochs, worker_step, apply, staleness=None, fresh_server=False):
    """Servers serve, workers run worker_step(worker, flat) per shared batch; returns the
    final flat parameters on workers. ``fresh_server``: a new Server object every epoch."""
    flat = np.zeros(sum(ps.counts), np.float32)
    role = Server(ps) if ps.is_server else Worker(ps, staleness)
    for _ in range(epochs):
        if ps.is_server and fresh_server:
            role = Server(ps)
        if ps.is_server:
            role.serve_epoch(apply)
        else:
            worker_step(role, flat)
            role.finish_epoch()
        ps.comm.Barrier()
        if not ps.is_server:
            role.pull(flat)
        ps.comm.Barrier()
        if ps.is_server:
            role.reset_epoch()
        ps.comm.Barrier()
    return role, flat


for MEMORY in ("window", "auto"):
    def expect_(cond, what, memory=MEMORY):
        expect(cond, f"[{memory}] {what}")

    probe = ParameterServer(comm, K, counts, memory=MEMORY)
    expect_(probe.memory == ("window" if MEMORY == "window" else
                             "shared" if g.node_count == 1 else "mixed"),
            f"the shards are in {probe.memory} ({probe.why_windows})")
    probe.free()

    # 1. every push applied exactly once
    M = 40
    ps = ParameterServer(comm, K, counts, memory=MEMORY)


    def pushes(worker, flat):
        for m in range(M):
            worker.pull(flat)
            worker.push(((np.arange(total) % 7) + worker.w * 3 + m % 5).astype(np.float32))


    def add(params, grad_sum, n):
        params += grad_sum


    role, flat = run_epochs(ps, 2, pushes, add)
    want = 2 * sum(((np.arange(total) % 7) + w * 3 + m % 5) for w in range(ps.num_workers)
                   for m in range(M)).astype(np.float32)
    if not ps.is_server:
        expect_(np.array_equal(flat, want), f"sum of racing pushes: got {flat[:5]} want {want[:5]}")
        expect_(len(role.staleness_seen) == 2 * M, "staleness recorded per push")
    applied = comm.allgather(role.pushes if ps.is_server else None)
    for p in applied[ps.num_workers:]:
        expect_(p == 2 * M * ps.num_workers, f"server applied {p} pushes, want {2 * M * ps.num_workers}")
    ps.free()

    # 1b. lock-step (S=0) with every worker, over epochs, a new Server object for each:
    # still every push exactly once
    ps = ParameterServer(comm, K, counts, memory=MEMORY)
    role, flat = run_epochs(ps, 2, pushes, add, staleness=0, fresh_server=True)
    if not ps.is_server:
        expect_(np.array_equal(flat, want), "S=0: sum of pushes")
    ps.free()

    # 2. SSP, over two epochs, worker w taking 12 - 4w steps (a finished worker holds no one
    # back but its pushes are waited for): no worker starts step c before every worker that is
    # still in the epoch has pushed c - S times
    for S in (0, 1):
        ps = ParameterServer(comm, K, counts, memory=MEMORY)
        log = []
        epoch = [0]

        def clocked(worker, flat):
            for c in range(max(12 - 4 * worker.w, 0)):
                worker.pull(flat)
                log.append(("start", epoch[0], c, time.monotonic()))
                time.sleep(0.002 * (1 + 3 * worker.w))  # worker w is (1 + 3w) times slower
                log.append(("push", epoch[0], c, time.monotonic()))
                worker.push(np.ones(total, np.float32))
            log.append(("done", epoch[0], -1, time.monotonic()))
            epoch[0] += 1

        run_epochs(ps, 2, clocked, add, staleness=S)
        logs = comm.allgather(log if not ps.is_server else None)[:ps.num_workers]
        for w, events in enumerate(logs):
            for kind, e, c, t in events:
                if kind != "start":
                    continue
                for w2, other in enumerate(logs):
                    mine = [x for x in other if x[1] == e]
                    finished = [t2 for k2, _, _, t2 in mine if k2 == "done"]
                    pushed_before = sum(1 for k2, _, _, t2 in mine if k2 == "push" and t2 < t)
                    if finished and finished[0] < t:
                        continue  # w2 had finished the epoch (all its pushes are waited for)
                    expect_(pushed_before >= c - S, f"SSP S={S}: worker {w} started step {c} of "
                           f"epoch {e} when worker {w2} had pushed {pushed_before}")
        ps.free()

    # 3. S=0, one worker (the others idle): equal to plain SGD on one process
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    reference = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    shapes = [p.shape for p in model.parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    ps = ParameterServer(comm, K, [p.numel() for p in model.parameters()], flat0,
                         memory=MEMORY)
    LR, STEPS = np.float32(0.1), 5


    def sgd(params, grad_sum, n):
        torch.from_numpy(params).add_(torch.from_numpy(grad_sum / np.float32(n)), alpha=-LR)


    def one_worker(worker, flat):
        if worker.w != 0:
            return
        for _ in range(STEPS):
            worker.pull(flat)
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(torch.from_numpy(flat.copy()),
                                                    model.parameters())
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            worker.push(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy())


    role, flat = run_epochs(ps, 1, one_worker, sgd, staleness=0)
    if not ps.is_server:
        local = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        with torch.no_grad():
            for p, r in zip(local.parameters(), reference):
                p.copy_(r)
        opt = torch.optim.SGD(local.parameters(), lr=float(LR))
        for _ in range(STEPS):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(local(x), y).backward()
            opt.step()
        want = torch.cat([p.detach().reshape(-1) for p in local.parameters()]).numpy()
        expect_(np.array_equal(flat, want), f"S=0 one worker vs SGD: max diff "
               f"{np.abs(flat - want).max()}")
    ps.free()


    # 4. whole shards and whole pushes, over 2 MiB
    N, PUSHES, PULLS = 1 << 19, 100, 4
    ps = ParameterServer(comm, K, [N], np.zeros(N, np.float32), memory=MEMORY)
    torn = []


    def uniform(params, grad_sum, n):
        if not (grad_sum == grad_sum[0]).all():
            torn.append(f"a drained sum of {n} pushes is not one value")
        params[...] = params[0] + 1  # each version one value throughout


    def whole(worker, flat):
        for _ in range(PUSHES):
            for _ in range(PULLS):  # the other workers' pushes are published meanwhile
                worker.pull(flat)
                for k in range(len(ps.servers)):  # each server's shard is one version
                    shard = ps.gather_shard(flat, k)
                    if not (shard == shard[0]).all():
                        torn.append(f"a pull of server {k}'s shard saw {shard.min()} and "
                                    f"{shard.max()}")
            worker.push(np.full(N, worker.w + 1, np.float32))


    role, flat = run_epochs(ps, 1, whole, uniform)
    expect_(not torn, f"{len(torn)} torn: {torn[:2]}")
    if ps.is_server:
        expect_(role.pushes == PUSHES * ps.num_workers, f"{role.pushes} pushes applied")
    ps.free()

results = comm.allgather(failures)
if g.rank == 0:
    for r, fs in enumerate(results):
        for f in fs[:10]:
            print(f"FAIL rank {r}: {f}", flush=True)
print(f"ok {g.rank}" if not any(results) else f"failed {g.rank}", flush=True)
