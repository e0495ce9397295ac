/* test_comm_lanes.c: the replica lane (comm_set_lane), a comm thread of its
 * own beside lane 0's.
 *   - Independence: rank 0 issues an all-reduce on the replica lane first,
 *     then an all-gather on lane 0; the other ranks issue the all-gather
 *     first and the all-reduce only once the gather is done. With one comm
 *     thread rank 0's gather would queue behind an all-reduce that waits
 *     for ranks that wait for that gather (the watchdog would end the job);
 *     on two lanes both finish, with the right values.
 *   - Order through data: a lane-0 gather that reads what a replica
 *     all-reduce writes sees the sum; a replica all-reduce of what a lane-0
 *     reduce-scatter writes sees the reduced block.
 *   - Figures: each lane's busy time is its own; the union is at most
 *     their sum and at least the larger of the two.
 *   - FSDP_COMM_LANES=1 (the np2 "one lane" run) keeps every communicator
 *     on lane 0, and the same data checks pass there (the independence
 *     case is skipped: it needs two lanes). */
#include "fsdp.h"
#include "comm_internal.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpi_testutil.h"

static int g_rank, g_size;

static fsdp_tensor *filled(int64_t n, float v) {
    fsdp_tensor *t = NULL;
    if (fsdp_tensor_empty(&t, FSDP_F32, 1, &n, FSDP_DEVICE_CPU, FSDP_TAG_OTHER) != FSDP_OK ||
        fsdp_fill(t, v) != FSDP_OK) {
        fprintf(stderr, "rank %d: tensor: %s\n", g_rank, fsdp_last_error());
        exit(1);
    }
    return t;
}

/* how many of t's n elements differ from want(i) */
static int64_t wrong(fsdp_tensor *t, int64_t n, float (*want)(int64_t), const char *what) {
    float *p = malloc((size_t)n * sizeof *p);
    int64_t bad = 0;
    if (!p || fsdp_tensor_to_data(t, p, n * (int64_t)sizeof *p) != FSDP_OK) bad = n;
    for (int64_t i = 0; i < n && !bad; i++)
        if (p[i] != want(i)) {
            fprintf(stderr, "FAIL (rank %d): %s: element %lld is %g, expected %g\n", g_rank, what, (long long)i,
                    p[i], want(i));
            bad++;
        }
    free(p);
    return bad;
}

static float sum_ranks(void) { return (float)(g_size * (g_size + 1) / 2); }   /* sum of rank + 1 */
static float want_sum(int64_t i) { (void)i; return sum_ranks(); }
static float want_block(int64_t i) { (void)i; return (float)g_size * sum_ranks(); }

static void t_independent(fsdp_comm *world, fsdp_comm *replica) {
    enum { N = 1031 };
    fsdp_tensor *acc = filled(N, (float)(g_rank + 1)), *part = filled(7, 1), *all = filled(7 * g_size, 0);
    fsdp_work *wr = NULL, *wg = NULL;
    if (g_rank == 0) {
        check(fsdp_all_reduce(&wr, replica, acc, FSDP_REDUCE_SUM, "lanes.replica") == FSDP_OK, "replica issue", 0);
        check(fsdp_all_gather(&wg, world, all, part, "lanes.gather") == FSDP_OK, "gather issue", 0);
        check(fsdp_work_wait(wg) == FSDP_OK, "the gather finishes while the replica all-reduce waits", 0);
    } else {
        check(fsdp_all_gather(&wg, world, all, part, "lanes.gather") == FSDP_OK, "gather issue", g_rank);
        check(fsdp_work_wait(wg) == FSDP_OK, "gather", g_rank);
        check(fsdp_all_reduce(&wr, replica, acc, FSDP_REDUCE_SUM, "lanes.replica") == FSDP_OK, "replica issue",
              g_rank);
    }
    check(fsdp_work_wait(wr) == FSDP_OK, "replica all-reduce", g_rank);
    check(wrong(acc, N, want_sum, "independent replica all-reduce") == 0, "replica sum", g_rank);
    fsdp_work_free(wr);
    fsdp_work_free(wg);
    fsdp_tensor_release(acc);
    fsdp_tensor_release(part);
    fsdp_tensor_release(all);
}

static void t_data_order(fsdp_comm *world, fsdp_comm *replica) {
    /* replica writes x, then lane 0 gathers from x: every block is the sum */
    enum { N = 13 };
    fsdp_tensor *x = filled(N, (float)(g_rank + 1)), *g = filled(N * g_size, -1);
    fsdp_work *w1 = NULL, *w2 = NULL;
    check(fsdp_all_reduce(&w1, replica, x, FSDP_REDUCE_SUM, "order.x") == FSDP_OK, "issue", g_rank);
    check(fsdp_all_gather(&w2, world, g, x, "order.gather") == FSDP_OK, "issue", g_rank);
    check(fsdp_work_wait(w2) == FSDP_OK && fsdp_work_wait(w1) == FSDP_OK, "waits", g_rank);
    check(wrong(g, N * g_size, want_sum, "lane-0 gather after a replica all-reduce of its source") == 0,
          "gather reads the replica's result", g_rank);
    fsdp_work_free(w1);
    fsdp_work_free(w2);
    fsdp_tensor_release(x);
    fsdp_tensor_release(g);

    /* lane 0 reduce-scatters into b, then the replica all-reduces b: size x the sum */
    enum { B = 5 };
    fsdp_tensor *src = filled(B * g_size, (float)(g_rank + 1)), *b = filled(B, 0);
    check(fsdp_reduce_scatter(&w1, world, b, src, FSDP_REDUCE_SUM, "order.rs") == FSDP_OK, "issue", g_rank);
    check(fsdp_all_reduce(&w2, replica, b, FSDP_REDUCE_SUM, "order.b") == FSDP_OK, "issue", g_rank);
    check(fsdp_work_wait(w2) == FSDP_OK && fsdp_work_wait(w1) == FSDP_OK, "waits", g_rank);
    check(wrong(b, B, want_block, "replica all-reduce after a lane-0 reduce-scatter into it") == 0,
          "the replica reads the reduce-scatter's result", g_rank);
    fsdp_work_free(w1);
    fsdp_work_free(w2);
    fsdp_tensor_release(src);
    fsdp_tensor_release(b);
}

static void t_figures(int lanes) {
    double busy = -1, b0 = -1, w0 = -1, b1 = -1, w1 = -1;
    check(fsdp_comm_busy(&busy) == FSDP_OK, "busy", g_rank);
    check(fsdp_comm_lane_stats(0, &b0, &w0) == FSDP_OK && fsdp_comm_lane_stats(1, &b1, &w1) == FSDP_OK,
          "lane stats", g_rank);
    check(b0 > 0 && w0 >= 0 && w1 >= 0, "lane 0 ran collectives", g_rank);
    check(lanes == 2 ? b1 > 0 : b1 == 0, "the replica lane's busy time is its own", g_rank);
    double hi = b0 > b1 ? b0 : b1;
    check(busy >= hi - 1e-9 && busy <= b0 + b1 + 1e-9, "the union lies between the larger lane and the sum",
          g_rank);
    if (busy < hi - 1e-9 || busy > b0 + b1 + 1e-9)
        fprintf(stderr, "rank %d: busy %.6f, lanes %.6f %.6f\n", g_rank, busy, b0, b1);
    check(fsdp_comm_lane_stats(2, &b0, &w0) == FSDP_ERR_INVALID && strstr(fsdp_last_error(), "lane 2"),
          "a lane out of range is refused, naming it", g_rank);
}

int main(void) {
    if (fsdp_runtime_init(&g_rank, &g_size) != FSDP_OK) {
        fprintf(stderr, "runtime init: %s\n", fsdp_last_error());
        return 1;
    }
    const char *env = getenv("FSDP_COMM_LANES");
    int lanes = env && !strcmp(env, "1") ? 1 : 2;
    fsdp_comm *world = NULL, *replica = NULL;
    check(fsdp_comm_world(&world) == FSDP_OK, "world", g_rank);
    check(comm_dup(&replica, world) == FSDP_OK, "dup", g_rank);
    comm_set_lane(replica, COMM_LANE_REPLICA);
    int want = lanes == 2 && g_size > 1 ? COMM_LANE_REPLICA : COMM_LANE_MAIN;
    check(comm_lane_of(replica) == want, "the replica communicator's lane", g_rank);
    check(comm_lane_of(world) == COMM_LANE_MAIN, "the world stays on lane 0", g_rank);
    /* a communicator that has queued a collective keeps its lane */
    comm_set_lane(world, COMM_LANE_REPLICA);
    check(comm_lane_of(world) == COMM_LANE_MAIN, "the world, which has run collectives, stays on lane 0", g_rank);

    fsdp_comm_reset_stats();
    if (want == COMM_LANE_REPLICA) t_independent(world, replica);
    t_data_order(world, replica);
    if (g_size > 1) t_figures(want == COMM_LANE_REPLICA ? 2 : 1);

    check(fsdp_comm_free(replica) == FSDP_OK, "free the replica communicator", g_rank);
    check(settle() == 0, "both lanes idle at the end", g_rank);
    double tot[2] = {(double)failures, (double)checks};
    check(fsdp_all_reduce_doubles(world, tot, 2, FSDP_REDUCE_SUM) == FSDP_OK, "verdict", g_rank);
    if (g_rank == 0)
        printf("test_comm_lanes: %d ranks, %d lane(s): %.0f of %.0f checks failed\n", g_size, lanes, tot[0], tot[1]);
    fsdp_comm_free(world);
    fsdp_runtime_finalize();
    return tot[0] == 0 && failures == 0 ? 0 : 1;
}
