/* The floor of an all-reduce between two ranks on two nodes: what moving its bytes costs
 * with no check and no algorithm around it, beside MPI_Allreduce, in one launch (bench/
 * RESULTS.md, "Across nodes, data in cache", issue 32 item 1). Two ranks, float32 sum, the
 * kinds taking turns, a tight loop over 3 buffers (data in cache up to the cache's size):
 *   mpi      MPI_Allreduce(MPI_IN_PLACE)
 *   halves   MPICH's own schedule for two ranks by hand: swap halves, add, swap the sums
 *   swap     both whole arrays swapped at once in 32 KiB chunks (8 in flight) and added:
 *            the bytes mpidp's doubling moves, without its check
 *   checked  a record of 88 B swapped first, then `swap`: mpidp's schedule (csrc/exchange.c)
 * Build and run (as root, from the repository root, the venv active):
 *   mpicc -O2 -o /tmp/link_floor bench/collectives/link_floor.c
 *   python tests/harness/multinode_cluster.py --nodes 2 -- \
 *       mpiexec -n 2 -ppn 1 /tmp/link_floor [KiB [MAX_BYTES]]
 * (KiB: the chunk size, default 32, mpidp's; MAX_BYTES: the largest size, default 16 MiB).
 * Prints each kind's median time per call (µs) over 7 repetitions at each size, after
 * checking that each kind sums small integers exactly (else it ends with exit code 1). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

enum { WINDOW = 8, REPS = 7, KINDS = 4, BUFS = 3, RECORD = 88 };
static size_t CHUNK = 32 << 10; /* argv[1] in KiB */
static float *tmp;
static char rec_out[RECORD], rec_in[RECORD];

static void add(float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

/* Posts chunk i of both arrays' swap (its receive into `tmp`, its send from `x`) in slot
 * i % WINDOW; returns its length in bytes. */
static size_t post(float *x, size_t bytes, size_t i, int peer, MPI_Request *rq) {
    size_t at = i * CHUNK, n = bytes - at < CHUNK ? bytes - at : CHUNK, s = i % WINDOW;
    MPI_Irecv((char *)tmp + at, (int)n, MPI_BYTE, peer, 2, MPI_COMM_WORLD, &rq[2 * s]);
    MPI_Isend((char *)x + at, (int)n, MPI_BYTE, peer, 2, MPI_COMM_WORLD, &rq[2 * s + 1]);
    return n;
}

/* Both arrays swapped in chunks, `WINDOW` in flight, each added as it arrives. */
static void swap(float *x, size_t bytes, int peer) {
    size_t nchunks = (bytes + CHUNK - 1) / CHUNK, len[WINDOW];
    MPI_Request rq[2 * WINDOW];
    for (size_t i = 0; i < nchunks && i < WINDOW; i++) len[i] = post(x, bytes, i, peer, rq);
    for (size_t i = 0; i < nchunks; i++) {
        size_t s = i % WINDOW, at = i * CHUNK;
        MPI_Waitall(2, &rq[2 * s], MPI_STATUSES_IGNORE);
        add((float *)((char *)x + at), (float *)((char *)tmp + at), len[s] / 4);
        if (i + WINDOW < nchunks) len[s] = post(x, bytes, i + WINDOW, peer, rq);
    }
}

static void run(int kind, float *x, size_t bytes, int rank) {
    int peer = 1 - rank;
    size_t half = bytes / 2 / 4 * 4;
    float *mine = rank == 0 ? x : (float *)((char *)x + half);
    float *theirs = rank == 0 ? (float *)((char *)x + half) : x;
    size_t mine_bytes = rank == 0 ? half : bytes - half;
    size_t theirs_bytes = bytes - mine_bytes;
    switch (kind) {
    case 0: MPI_Allreduce(MPI_IN_PLACE, x, (int)(bytes / 4), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    case 1:
        MPI_Sendrecv(theirs, (int)theirs_bytes, MPI_BYTE, peer, 1, tmp, (int)mine_bytes,
                     MPI_BYTE, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        add(mine, tmp, mine_bytes / 4);
        MPI_Sendrecv(mine, (int)mine_bytes, MPI_BYTE, peer, 1, theirs, (int)theirs_bytes,
                     MPI_BYTE, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        break;
    case 3:
        MPI_Sendrecv(rec_out, RECORD, MPI_BYTE, peer, 3, rec_in, RECORD, MPI_BYTE, peer, 3,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        /* fall through */
    case 2: swap(x, bytes, peer);
    }
}

/* 1 when kind `k` sums rank + 1 + i % 7 over both ranks exactly on every element. */
static int exact(int k, float *x, size_t bytes, int rank) {
    size_t n = bytes / 4;
    for (size_t i = 0; i < n; i++) x[i] = (float)(rank + 1 + i % 7);
    run(k, x, bytes, rank);
    int ok = 1;
    for (size_t i = 0; i < n; i++) ok &= x[i] == (float)(3 + 2 * (i % 7));
    for (size_t i = 0; i < n; i++) x[i] = 0.0f;
    return ok;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int provided; /* MPI_THREAD_MULTIPLE, as mpi4py asks for mpidp */
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    if (argc > 1) CHUNK = (size_t)atoi(argv[1]) << 10;
    size_t max_bytes = argc > 2 ? (size_t)atol(argv[2]) : (size_t)16 << 20;
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size != 2) {
        if (!rank) fprintf(stderr, "link_floor: two ranks, one per node\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
        return 2; /* MPI_Abort may return before the launcher ends the job */
    }
    if (CHUNK < 1024 || CHUNK > (1 << 30)) {
        if (!rank) fprintf(stderr, "link_floor: a chunk of %s KiB (1 to 1048576)\n", argv[1]);
        MPI_Abort(MPI_COMM_WORLD, 2);
        return 2; /* MPI_Abort may return before the launcher ends the job */
    }
    static const size_t sizes[] = {8, 32 << 10, 64 << 10, 128 << 10, 1 << 20, 16 << 20};
    static const char *names[KINDS] = {"mpi", "halves", "swap", "checked"};
    if (!rank) printf("# chunks of %zu KiB, %d in flight; MPI thread level %d\n", CHUNK >> 10,
                      WINDOW, provided);
    if (!rank) printf("%10s %10s %10s %10s %10s\n", "bytes", names[0], names[1], names[2],
                      names[3]);
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        size_t bytes = sizes[s];
        if (bytes > max_bytes) break;
        int iters = bytes >= (1 << 20) ? 10 : 200;
        float *bufs[BUFS];
        for (int b = 0; b < BUFS; b++) {
            bufs[b] = malloc(bytes);
            for (size_t i = 0; i < bytes / 4; i++) bufs[b][i] = 0.0f;
        }
        tmp = malloc(bytes);
        for (int k = 0; k < KINDS; k++) {
            int ok = exact(k, bufs[0], bytes, rank), all;
            MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
            if (!all) {
                if (!rank) fprintf(stderr, "link_floor: %s: a wrong sum at %zu B\n", names[k],
                                   bytes);
                MPI_Abort(MPI_COMM_WORLD, 1);
                return 1;
            }
        }
        double t[KINDS][REPS];
        for (int r = 0; r < REPS; r++)
            for (int k = 0; k < KINDS; k++) {
                for (int i = 0; i < 3; i++) run(k, bufs[i % BUFS], bytes, rank);
                MPI_Barrier(MPI_COMM_WORLD);
                double t0 = MPI_Wtime();
                for (int i = 0; i < iters; i++) run(k, bufs[i % BUFS], bytes, rank);
                t[k][r] = (MPI_Wtime() - t0) / iters * 1e6;
            }
        if (!rank) {
            printf("%10zu", bytes);
            for (int k = 0; k < KINDS; k++) {
                qsort(t[k], REPS, sizeof(double), by_value);
                printf(" %10.1f", t[k][REPS / 2]);
            }
            printf("\n");
            fflush(stdout);
        }
        for (int b = 0; b < BUFS; b++) free(bufs[b]);
        free(tmp);
    }
    MPI_Finalize();
    return 0;
}
