"""Tier 2: the collectives under real MPI (at n = 1, 2, 3 as they are: test_together.py; 4
oversubscribed as a smoke), in every peer mode and with emulated nodes for the hierarchical
algorithm (each rank a node of its own: 2 x 1 here, and 2 x 1 and 3 x 1 in tests/multinode on
nodes in namespaces)."""

from mpirun import assert_ok, body, together


def test_collectives_through_staging_window():
    """Where cross-memory attach is not allowed, shm stages through a shared window (the
    algorithms that use shared memory; ring, doubling and mpi go over MPI in any peer mode)."""
    env = {"MPIDP_SHM_PEERS": "window", "BODY_ALGORITHMS": "auto,shm,hier"}
    assert_ok(body(3, "body_collectives.py", env=env), 3)


def test_collectives_with_each_rank_a_node():
    """MPIDP_EMULATE_NODE_SIZE=1 on one host: the all-reduce across nodes in one C call
    (csrc/exchange.c), its records inline and chunked, and their disagreements, also where
    tests/multinode (nodes in namespaces, root needed) cannot run; 3 x 1 runs there."""
    env = {"MPIDP_EMULATE_NODE_SIZE": "1", "BODY_ALGORITHMS": "auto,hier,doubling,ring",
           "BODY_EXPECT_C_EXCHANGE": "1"}
    assert_ok(body(2, "body_collectives.py", env=env), 2)


def test_four_ranks_two_emulated_nodes_smoke():
    env = {"MPIDP_EMULATE_NODE_SIZE": "2", "BODY_BIG_COUNT": "100000",
           "BODY_ALGORITHMS": "auto,shm,hier,ring"}
    assert_ok(body(4, "body_collectives.py", env=env, timeout_s=400), 4)


def test_core_collectives_without_the_c_extension():
    """MPIDP_EXTENSION=0: the numpy twin reduces, auto runs over MPI (no shared memory), and
    the start-up warning says so; bad inputs still raise on every rank (one launch for both)."""
    env = {"MPIDP_EXTENSION": "0", "BODY_ALGORITHMS": "auto,ring,mpi", "BODY_TRIALS": "15",
           "BODY_BIG_COUNT": "300000"}
    proc = together(2, ("body_collectives.py", "body_bad_inputs.py"), env=env)
    assert "one-node collectives run over MPI instead of shared memory" in proc.stderr
