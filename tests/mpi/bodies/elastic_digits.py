"""A training script written for Horovod's elastic API, as Horovod's elastic PyTorch examples
are (examples/elastic/pytorch at v0.28.1), on mpidp.horovod: its import line changed. The
digits on a small MLP, a DistributedOptimizer, an ElasticSampler, a TorchState committed
every COMMIT_EVERY batches (default 1), the loss averaged for the log between the backward
and the step (so a lost rank may be met there, the gradients' buckets in flight), a reset
callback that rescales the learning rate to the new size. The data may kill ranks
(user_factories.DyingDataset: DIE_RANK at its DIE_AT_ITEM-th item, once each with
FAULT_ONCE_FILE). Rank 0 prints, at the end, 'elastic: ranks <size> resets <n> sha256 <the
parameters' digest>'; every rank 'steps <rank> <optimizer steps this process took>' and
'ok <rank>'."""
import hashlib
import os

import torch
import torch.nn.functional as F

import mpidp.horovod as hvd
from mpidp.workloads import data
from user_factories import DyingDataset

EPOCHS, BATCH, LR = 2, 16, 0.05
COMMIT_EVERY = int(os.environ.get("COMMIT_EVERY", "1"))

hvd.init()
torch.manual_seed(0)
dataset = DyingDataset(data.digits()[0])
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                            torch.nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=LR * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
resets, steps = [], [0]


def on_state_reset():
    resets.append(hvd.size())
    for group in optimizer.param_groups:
        group["lr"] = LR * hvd.size()


def end_epoch(state):
    state.epoch += 1
    state.batch = 0
    state.train_sampler.set_epoch(state.epoch)
    state.commit()


@hvd.elastic.run
def train(state):
    while state.epoch < EPOCHS:
        for x, y in loader:  # what is left of the epoch, dealt over the ranks there are
            state.optimizer.zero_grad()
            loss = F.cross_entropy(state.model(x), y)
            loss.backward()
            hvd.allreduce(loss.detach(), name="loss")  # for the log
            state.optimizer.step()
            steps[0] += 1
            state.train_sampler.record_batch(state.batch, BATCH)
            state.batch += 1
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
        end_epoch(state)


state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                 for p in model.state_dict().values())).hexdigest()
if hvd.rank() == 0:
    print(f"elastic: ranks {hvd.size()} resets {len(resets)} sha256 {digest}", flush=True)
print(f"steps {hvd.rank()} {steps[0]}", flush=True)
print(f"ok {hvd.rank()}", flush=True)
