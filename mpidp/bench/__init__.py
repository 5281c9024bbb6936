"""``python -m mpidp.bench``: the measurements mpidp ships to its users, run on their own cluster
(all-reduce per algorithm against MPI_Allreduce and gloo, fusion, the GPU kernels, training
throughput, the scale model). The project's own comparisons — against Horovod, gloo's DDP,
a strategy against another over emulated links — are the scripts in the repository's bench/,
which call this harness where it measures the same thing, and record their figures in
bench/RESULTS.md (docs/benchmarks.md: which measurement lives where)."""
