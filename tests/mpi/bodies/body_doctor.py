"""Run under mpiexec: ``python -m mpidp.doctor`` with one probe sabotaged on one rank —
BODY_DOCTOR_RAISE_ON=r makes the Slurm probe raise there (the doctor must report it and go
on), BODY_DOCTOR_HANG_ON=r makes the one-sided probe sleep there (the deadline must abort the
job, naming the check)."""
import os
import sys
import time

from mpi4py import MPI

from mpidp import doctor
from mpidp.doctor import probes

rank = MPI.COMM_WORLD.Get_rank()
raise_on = os.environ.get("BODY_DOCTOR_RAISE_ON")
hang_on = os.environ.get("BODY_DOCTOR_HANG_ON")
if raise_on is not None and rank == int(raise_on):
    def broken(ctx):
        raise OSError("deliberate failure in the Slurm probe")
    doctor.CHECKS = tuple((n, broken if p is probes.slurm else p, v) for n, p, v in doctor.CHECKS)
if hang_on is not None and rank == int(hang_on):
    def stuck(ctx):
        time.sleep(120)
    doctor.CHECKS = tuple((n, stuck if p is probes.one_sided else p, v)
                          for n, p, v in doctor.CHECKS)
sys.exit(doctor.main(sys.argv[1:]))
