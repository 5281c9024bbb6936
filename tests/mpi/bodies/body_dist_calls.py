"""Run under mpiexec at any world size, without MASTER_ADDR: which thread runs torch's operations
on the "mpidp" backend (Note [Synchronous calls on the caller's thread] in
mpidp/comm/scheduler.py), recorded with ``threading.get_ident()`` inside the operation — a
synchronous call on the caller's thread, an asynchronous one on the group's thread, a
synchronous call made while asynchronous work is queued or running behind it and in order,
torch's DDP's bucket all-reduces on the group's thread (so backward goes on meanwhile), a
synchronous call from a Work's callback — with every result exact (at n = 1, where the
group has no thread, nothing to check). Prints 'ok <rank>'."""
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from bodykit import expect, finish
from mpidp.backend import ops

torch.set_num_threads(1)
dist.init_process_group("mpidp")
rank, n = dist.get_rank(), dist.get_world_size()
if n == 1:  # a group of one has no thread: each call completes at once (body_dist.py checks)
    dist.destroy_process_group()
    finish(rank)
    sys.exit(0)
caller = threading.get_ident()
log = []  # (tensor's element count, thread) in the order the all-reduces ran
hold = threading.Event()  # an all-reduce of 3 elements waits for it on the thread it runs on
real_all_reduce = ops.all_reduce


def recorded(g, t, op):
    log.append((t.numel(), threading.get_ident()))
    if t.numel() == 3:
        hold.wait(30)
    real_all_reduce(g, t, op)


ops.all_reduce = recorded  # group.py calls it through the module
total = n * (n + 1) / 2  # the sum of every rank's rank + 1

# ---- a synchronous call runs on the caller's thread; an asynchronous one on the group's ----
t = torch.full((4,), rank + 1.0)
dist.all_reduce(t)
sync_thread = log[-1][1]
u = torch.full((5,), rank + 1.0)
work = dist.all_reduce(u, async_op=True)
work.wait()
async_thread = log[-1][1]

# ---- a synchronous call behind queued asynchronous work waits its turn -------------------
log.clear()
a, b = torch.full((3,), rank + 1.0), torch.full((6,), rank + 1.0)
first = dist.all_reduce(a, async_op=True)  # held on the group's thread until `hold` is set
thread = dist.distributed_c10d._get_default_group()._thread


def release():  # once the synchronous call below is queued behind the held one
    while thread.queued - thread.finished < 2:
        time.sleep(0.001)
    hold.set()


threading.Thread(target=release, daemon=True).start()
dist.all_reduce(b)  # must run after `a`, on the group's thread
after_b = first.is_completed()
first.wait()
order = list(log)

# ---- a synchronous call made from a Work's callback (on the group's thread) completes ----
inner = torch.full((2,), rank + 1.0)


def from_callback(fut):
    dist.all_reduce(inner)  # the group's thread is running this callback: it runs here
    return fut.value()


dist.all_reduce(torch.ones(1), async_op=True).get_future().then(from_callback).wait()

# ---- torch's DDP: its bucket all-reduces run on the group's thread ------------------------
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)  # a bucket per layer
x = torch.arange(32, dtype=torch.float32).reshape(4, 8) / 32 + rank
ddp(x).sum().backward()  # the first step's one bucket; then a bucket per layer
log.clear()
ddp(x).sum().backward()
ddp_threads = {thread for _, thread in log}
grads = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
everyone = [torch.empty_like(grads) for _ in range(n)]
dist.all_gather(everyone, grads)

expect(sync_thread == caller, "a synchronous all_reduce ran on the group's thread, not the "
       "caller's")
expect(async_thread != caller, "an asynchronous all_reduce ran on the caller's thread")
expect(torch.equal(t, torch.full((4,), total)), f"synchronous all_reduce: {t.tolist()}")
expect(torch.equal(u, torch.full((5,), total)), f"asynchronous all_reduce: {u.tolist()}")
expect([count for count, _ in order] == [3, 6], f"order of the all-reduces: {order}")
expect(len({thread for _, thread in order}) == 1 and order[0][1] != caller,
       f"the queued one and the synchronous one behind it ran on {order} (caller {caller})")
expect(torch.equal(inner, torch.full((2,), total)), f"all_reduce from a callback: {inner}")
expect(after_b, "the synchronous all_reduce returned before the asynchronous one queued "
       "before it completed")
expect(torch.equal(a, torch.full((3,), total)) and torch.equal(b, torch.full((6,), total)),
       f"queued and synchronous all_reduce: {a.tolist()}, {b.tolist()}")
expect(len(log) >= 2, f"DDP's backward all-reduced {len(log)} buckets")
expect(caller not in ddp_threads, "DDP's bucket all-reduces ran on the caller's thread, "
       "which would wait for each bucket in backward instead of overlapping them")
expect(all(torch.equal(e, grads) for e in everyone), "DDP's gradients differ across ranks")
ops.all_reduce = real_all_reduce  # as it was, for what runs after this in the process
dist.destroy_process_group()
finish(rank)
