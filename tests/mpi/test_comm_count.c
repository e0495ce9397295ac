/* test_comm_count.c: the counting communicator (fsdp_comm_new_counting):
 * world N played by one process as rank r. Every collective's result must
 * be that of a world whose ranks all hold this rank's values, computed here
 * independently in double precision, and its traffic must be counted per
 * kind with the bytes fsdp.h defines. Runs without mpirun, for several
 * (world, rank) pairs, awkward sizes included. */
#include "fsdp.h"
#include "testutil.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OK(call) test_check((call) == FSDP_OK, "%s: %s", #call, fsdp_last_error())

static fsdp_tensor *f32_tensor(const float *x, int64_t n) {
    fsdp_tensor *t = NULL;
    OK(fsdp_tensor_from_data(&t, FSDP_F32, 1, &n, x, n * 4, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
    return t;
}

static void read_f32(fsdp_tensor *t, float *out, int64_t n) { OK(fsdp_tensor_to_data(t, out, n * 4)); }

static void expect_counts(fsdp_comm *c, int kind, int64_t calls, int64_t bytes, const char *what) {
    int64_t got_calls = -1, got_bytes = -1;
    OK(fsdp_comm_counts(c, kind, &got_calls, &got_bytes));
    test_check(got_calls == calls && got_bytes == bytes, "%s: counts of kind %d: %lld calls, %lld bytes; expected "
               "%lld, %lld", what, kind, (long long)got_calls, (long long)got_bytes, (long long)calls,
               (long long)bytes);
}

static void one_world(int world, int rank) {
    char what[64];
    snprintf(what, sizeof what, "world %d rank %d", world, rank);
    fsdp_comm *c = NULL;
    OK(fsdp_comm_new_counting(&c, world, rank));
    int r = -1, s = -1;
    OK(fsdp_comm_info(c, &r, &s));
    test_check(r == rank && s == world, "%s: info says rank %d of %d", what, r, s);

    test_rng rng;
    test_rng_seed(&rng, (uint64_t)(world * 131 + rank));
    const int64_t n = 7;   /* per-rank block: odd, prime */
    float x[7], full[7 * 8];
    for (int64_t i = 0; i < n; i++) x[i] = (float)(test_rng_uniform(&rng) * 2 - 1);

    /* all-gather: every block is this rank's block */
    fsdp_tensor *src = f32_tensor(x, n);
    int64_t total = n * world;
    fsdp_tensor *dst = NULL;
    OK(fsdp_tensor_zeros(&dst, FSDP_F32, 1, &total, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
    OK(fsdp_all_gather(NULL, c, dst, src, "gather"));
    read_f32(dst, full, total);
    double want[7 * 8];
    for (int b = 0; b < world; b++)
        for (int64_t i = 0; i < n; i++) want[b * n + i] = x[i];
    if (test_compare(what, full, want, total, 0, 0)) test_check(0, "%s: all_gather", what);
    else test_check(1, "%s: all_gather", what);

    /* reduce-scatter: sum = world * this rank's block of src; avg = the block */
    float big[7 * 8];
    for (int64_t i = 0; i < total; i++) big[i] = (float)(test_rng_uniform(&rng) * 2 - 1);
    fsdp_tensor *rs_src = f32_tensor(big, total);
    fsdp_tensor *rs_dst = NULL;
    OK(fsdp_tensor_zeros(&rs_dst, FSDP_F32, 1, &n, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
    for (int op = FSDP_REDUCE_SUM; op <= FSDP_REDUCE_AVG; op++) {
        OK(fsdp_reduce_scatter(NULL, c, rs_dst, rs_src, op, "rs"));
        float got[7];
        read_f32(rs_dst, got, n);
        for (int64_t i = 0; i < n; i++) want[i] = (double)big[rank * n + i] * (op == FSDP_REDUCE_SUM ? world : 1);
        test_check(test_compare(what, got, want, n, 1e-6, 1e-6) == 0, "%s: reduce_scatter op %d", what, op);
    }

    /* all-reduce: sum = world * x, avg and max = x */
    int ops[3] = {FSDP_REDUCE_SUM, FSDP_REDUCE_AVG, FSDP_REDUCE_MAX};
    for (int k = 0; k < 3; k++) {
        fsdp_tensor *t = f32_tensor(x, n);
        OK(fsdp_all_reduce(NULL, c, t, ops[k], "ar"));
        float got[7];
        read_f32(t, got, n);
        for (int64_t i = 0; i < n; i++) want[i] = (double)x[i] * (ops[k] == FSDP_REDUCE_SUM ? world : 1);
        test_check(test_compare(what, got, want, n, 1e-6, 1e-6) == 0, "%s: all_reduce op %d", what, ops[k]);
        fsdp_tensor_release(t);
    }
    int64_t iv[3] = {5, -3, 1LL << 40}, one = 3;
    fsdp_tensor *ti = NULL;
    OK(fsdp_tensor_from_data(&ti, FSDP_I64, 1, &one, iv, 24, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
    OK(fsdp_all_reduce(NULL, c, ti, FSDP_REDUCE_SUM, "ari"));
    int64_t gi[3];
    OK(fsdp_tensor_to_data(ti, gi, 24));
    test_check(gi[0] == 5 * world && gi[1] == -3 * world && gi[2] == (1LL << 40) * world,
               "%s: i64 sum: %lld %lld %lld", what, (long long)gi[0], (long long)gi[1], (long long)gi[2]);
    fsdp_tensor_release(ti);

    /* broadcast: unchanged */
    fsdp_tensor *tb = f32_tensor(x, n);
    OK(fsdp_broadcast(NULL, c, tb, world - 1, "bc"));
    float gb[7];
    read_f32(tb, gb, n);
    test_check(memcmp(gb, x, sizeof gb) == 0, "%s: broadcast left the tensor as it was", what);
    fsdp_tensor_release(tb);

    OK(fsdp_barrier(c));
    double d[2] = {1.5, -2};
    OK(fsdp_all_reduce_doubles(c, d, 2, FSDP_REDUCE_SUM));
    test_check(d[0] == 1.5 * world && d[1] == -2.0 * world, "%s: doubles sum %g %g", what, d[0], d[1]);

    /* counts: bytes per rank as fsdp.h defines them */
    expect_counts(c, FSDP_COLL_ALL_GATHER, 1, total * 4, what);
    expect_counts(c, FSDP_COLL_REDUCE_SCATTER, 2, 2 * total * 4, what);
    expect_counts(c, FSDP_COLL_ALL_REDUCE, 4, 3 * n * 4 + 24, what);
    expect_counts(c, FSDP_COLL_BROADCAST, 1, n * 4, what);
    expect_counts(c, FSDP_COLL_BARRIER, 1, 0, what);
    expect_counts(c, FSDP_COLL_ALL_REDUCE_DOUBLES, 1, 16, what);

    /* splits: plain ones cannot be answered in one process; split_all can */
    fsdp_comm *child = NULL;
    test_check(fsdp_comm_split(&child, c, 0, 0) == FSDP_ERR_UNSUPPORTED && child == NULL &&
               strstr(fsdp_last_error(), "fsdp_comm_split_all") != NULL,
               "%s: plain split refused, naming fsdp_comm_split_all: %s", what, fsdp_last_error());
    int colors[8], keys[8];
    for (int q = 0; q < world; q++) {
        colors[q] = q / 2;           /* groups of 2 (the last one may be 1) */
        keys[q] = world - q;         /* reversed order inside the group */
    }
    OK(fsdp_comm_split_all(&child, c, colors, keys, world));
    int cr = -1, cs = -1;
    if (child) OK(fsdp_comm_info(child, &cr, &cs));
    int want_size = (rank / 2) * 2 + 1 < world ? 2 : 1;
    int want_rank = want_size == 2 ? 1 - rank % 2 : 0;
    test_check(cr == want_rank && cs == want_size, "%s: split_all into pairs: rank %d of %d, expected %d of %d",
               what, cr, cs, want_rank, want_size);
    /* the child's traffic counts in the parent's family */
    if (child) {
        OK(fsdp_barrier(child));
        expect_counts(c, FSDP_COLL_BARRIER, 2, 0, what);
        OK(fsdp_comm_free(child));
    }
    test_check(fsdp_comm_split_all(&child, c, colors, keys, world + 1) == FSDP_ERR_INVALID,
               "%s: split_all with a table of the wrong length refused: %s", what, fsdp_last_error());
    OK(fsdp_comm_reset_counts(c));
    expect_counts(c, FSDP_COLL_ALL_GATHER, 0, 0, what);

    fsdp_tensor_release(src);
    fsdp_tensor_release(dst);
    fsdp_tensor_release(rs_src);
    fsdp_tensor_release(rs_dst);
    OK(fsdp_comm_free(c));
}

int main(void) {
    int pairs[][2] = {{1, 0}, {2, 1}, {3, 2}, {4, 0}, {5, 3}, {8, 7}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) one_world(pairs[i][0], pairs[i][1]);
    fsdp_comm *c = NULL;
    test_check(fsdp_comm_new_counting(&c, 0, 0) == FSDP_ERR_INVALID && c == NULL, "world 0 refused: %s",
               fsdp_last_error());
    test_check(fsdp_comm_new_counting(&c, 4, 4) == FSDP_ERR_INVALID, "rank 4 of 4 refused: %s", fsdp_last_error());
    test_check(fsdp_comm_new_counting(&c, 4, -1) == FSDP_ERR_INVALID, "rank -1 refused: %s", fsdp_last_error());
    test_check(fsdp_comm_new_counting(NULL, 4, 0) == FSDP_ERR_INVALID, "out NULL refused");
    fsdp_runtime_finalize();
    return test_summary();
}
