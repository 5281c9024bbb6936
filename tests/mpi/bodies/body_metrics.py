"""Run under mpiexec at any world size: torchmetrics metrics synchronised over the "mpidp"
backend equal the same metrics computed by one process on the concatenated data — accuracy,
mean squared error, and a CatMetric of a different number of values on every rank (torchmetrics
gathers them padded). Prints 'ok <rank>'."""
import sys

import torch
import torch.distributed as dist
import torchmetrics

dist.init_process_group("mpidp")
rank, n = dist.get_rank(), dist.get_world_size()
failures = []
gen = torch.Generator().manual_seed(3)
sizes = [5 + r for r in range(n)]  # uneven: rank r holds 5 + r samples
logits = [torch.randn(s, 4, generator=gen) for s in sizes]
labels = [torch.randint(0, 4, (s,), generator=gen) for s in sizes]
values = [torch.randint(-9, 10, (s,), generator=gen).float() for s in sizes]


def metrics(sync):
    return {"accuracy": torchmetrics.classification.MulticlassAccuracy(
                num_classes=4, sync_on_compute=sync),
            "mse": torchmetrics.MeanSquaredError(sync_on_compute=sync),
            "cat": torchmetrics.CatMetric(sync_on_compute=sync)}


mine, whole = metrics(True), metrics(False)  # whole: this process alone, on all the data
for name, m in mine.items():
    if name == "cat":
        m.update(values[rank])
        whole[name].update(torch.cat(values))
    elif name == "mse":
        m.update(logits[rank][:, 0], values[rank])
        whole[name].update(torch.cat(logits)[:, 0], torch.cat(values))
    else:
        m.update(logits[rank], labels[rank])
        whole[name].update(torch.cat(logits), torch.cat(labels))
for name in mine:
    got, expected = mine[name].compute(), whole[name].compute()
    if name == "cat":
        got, expected = got.sort().values, expected.sort().values
    if not torch.allclose(got, expected, rtol=1e-6):
        failures.append(f"{name}: {got} != {expected}")

if failures:
    print(f"rank {rank}: " + "\n".join(failures), flush=True)
    sys.exit(1)
dist.destroy_process_group()
print(f"ok {rank}", flush=True)
