"""Horovod names this module does not serve yet: each raises, in one line, what to use
instead (docs/horovod.md). Every rank of a script calls them at the same point, so every
rank raises there; none waits in a collective."""
from __future__ import annotations


def _not_yet(name: str, instead: str):
    def refused(*args, **kwargs):
        raise NotImplementedError(f"mpidp.horovod: hvd.{name} is not supported yet; {instead}")
    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused: {instead}."
    return refused


alltoall = _not_yet("alltoall", "use torch.distributed.all_to_all_single on the mpidp backend")
alltoall_async = _not_yet("alltoall_async", "use torch.distributed.all_to_all_single on the "
                          "mpidp backend")
join = _not_yet("join", "give every rank the same number of batches, or use "
                "mpidp.DistributedDataParallel's join()")
add_process_set = _not_yet("add_process_set", "run on the global process set, or give "
                           "mpidp.init a sub-communicator")
remove_process_set = _not_yet("remove_process_set", "run on the global process set")
start_timeline = _not_yet("start_timeline", "set MPIDP_TIMELINE=file.json before the job "
                          "starts (docs/configuration.md)")
stop_timeline = _not_yet("stop_timeline", "set MPIDP_TIMELINE=file.json before the job starts")
