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
