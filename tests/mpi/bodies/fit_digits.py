"""A user's script on ``mpidp.fit``: the digits (user_factories.dying_digits: DIE_RANK kills
itself at its DIE_AT_ITEM-th item, once with FAULT_ONCE_FILE), the built-in MLP seeded as
``python -m mpidp.train`` seeds it, Adam for 3 epochs on the CPU, no progress bar: the run of
tests/mpi/test_open_mpi.py's FLAGS, from a script. Under fault tolerance a replacement of a
lost rank runs this script anew and joins the run at its own ``mpidp.fit`` (Note [Recovering
a run] in mpidp/train/in_job.py). Rank 0 prints the summary (JSON) as the tool does."""
import torch

import mpidp
from mpidp.workloads import models
from user_factories import dying_digits

train, test = dying_digits()
torch.manual_seed(0)  # TrainSettings.seed, which python -m mpidp.train seeds the model with
model = models.build("mlp", (1, 8, 8), 10)
mpidp.fit(model, train, test, epochs=3, optimizer="adam", progress=False, device="cpu")
