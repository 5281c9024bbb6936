"""What the test bodies under mpiexec share: failures collected with ``expect`` and reported by
``finish`` ('ok <rank>' on success, the failures and exit 1 otherwise)."""
import sys

failures = []


def expect(cond, what: str) -> None:
    if not cond:
        failures.append(what)


def finish(rank: int) -> None:
    if failures:
        print(f"rank {rank}: " + "\n".join(failures), flush=True)
        sys.exit(1)
    print(f"ok {rank}", flush=True)


def sgd_steps(ddp, batches, accumulate: bool = False) -> list:
    """SGD with momentum (lr 0.1) over ``batches`` of (inputs, labels) with cross-entropy;
    with ``accumulate`` every other batch's gradient is accumulated in ``no_sync`` and
    reduced with the next one's. Returns copies of the parameters."""
    import torch
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for k, (x, y) in enumerate(batches):
        if accumulate and k % 2 == 0:
            with ddp.no_sync():
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
            continue
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.parameters()]
