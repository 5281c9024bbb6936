"""``python -m mpidp.run``: a supervisor that launches a training job and, when it fails,
relaunches it with --resume on the nodes that still answer (Note [Supervising a run] in
supervisor.py). Imports neither torch nor MPI."""
