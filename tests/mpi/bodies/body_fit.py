"""mpidp.fit and Trainer from a user's script: a model and data of the user's own, the same
run twice gives the same parameters, central equals mirrored on two ranks, a summary returned
on every rank."""
import torch

import mpidp
from mpidp.workloads import data

g = mpidp.init()
train, test = data.digits()


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 10))


runs = {}
for strategy in ("mirrored", "central"):
    model = net()
    runs[strategy] = mpidp.fit(model, train, test, strategy=strategy, epochs=2, batch_size=16,
                               optimizer="sgd", lr=0.1, progress=False, seed=4,
                               loss_fn=torch.nn.functional.cross_entropy)
again = mpidp.Trainer(mpidp.TrainSettings(epochs=2, batch_size=16, optimizer="sgd", lr=0.1,
                                          progress=False, seed=4)).fit(net(), train, test)
try:
    mpidp.fit(net(), train, batch_size=0)
    raise AssertionError("batch_size=0 accepted")
except ValueError as exc:
    assert "--batch-size" in str(exc)
if g.size > 1:  # settings that differ between ranks are named, not waited on
    try:
        mpidp.fit(net(), train, test, epochs=2 + (g.rank == 1), progress=False)
        raise AssertionError("different epochs per rank accepted")
    except mpidp.train.SetupError as exc:
        assert "rank 1 has epochs=3 where rank 0 has 2" in str(exc), exc
    try:
        mpidp.fit(net(), train, test if g.rank == 0 else None, progress=False)
        raise AssertionError("a held-out set on rank 0 only accepted")
    except mpidp.train.SetupError as exc:
        assert "test_samples=None where rank 0 has 359" in str(exc), exc
assert runs["mirrored"]["final_accuracy"] > 0.5, runs
assert runs["mirrored"]["model"] == "Sequential" and runs["mirrored"]["dataset"] == "TensorDataset"
assert again["parameters_sha256"] == runs["mirrored"]["parameters_sha256"]
if g.size <= 2:
    assert runs["central"]["parameters_sha256"] == runs["mirrored"]["parameters_sha256"]
print(f"ok {g.rank}", flush=True)
