/* test_comm_mismatch.c: with FSDP_DEBUG_COLLECTIVES=1, a collective whose
 * ranks disagree fails on every rank, naming the first mismatch, and the
 * communicator stays usable (the mismatched transfer never ran).
 * Needs 2 or more ranks; with one it only checks that debug mode is harmless. */
#include "fsdp.h"
#include "testutil.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_rank, g_world;
static int64_t g_local_fail;

static void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(int ok, const char *fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    test_check(ok, "rank %d: %s", g_rank, buf);
    if (!ok) g_local_fail++;
}

#define OK(call) check((call) == FSDP_OK, "%s: %s", #call, fsdp_last_error())

static fsdp_tensor *filled(int dtype, int64_t n, double v) {
    fsdp_tensor *t = NULL;
    OK(fsdp_tensor_empty(&t, dtype, 1, &n, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
    OK(fsdp_fill(t, v));
    return t;
}

/* A sum that must still be right after a failed collective. */
static void still_in_step(fsdp_comm *c, int s, const char *after) {
    fsdp_tensor *t = filled(FSDP_F32, 4, 1.0);
    OK(fsdp_all_reduce(NULL, c, t, FSDP_REDUCE_SUM, "in.step"));
    float v[4] = {0};
    OK(fsdp_tensor_to_data(t, v, sizeof v));
    check(v[0] == (float)s && v[3] == (float)s, "all_reduce after %s: %g, expected %d", after, v[0], s);
    fsdp_tensor_release(t);
}

static void expect_mismatch(fsdp_status st, const char *what, const char *parts[], int nparts) {
    const char *m = fsdp_last_error();
    check(st == FSDP_ERR_COMM, "%s: status %d, expected FSDP_ERR_COMM (%s)", what, (int)st, m);
    for (int k = 0; k < nparts; k++) check(strstr(m, parts[k]) != NULL, "%s: message lacks \"%s\": %s", what, parts[k], m);
    if (g_rank == 0) fprintf(stderr, "note: %s: %s\n", what, m);
}

int main(void) {
    setenv("FSDP_DEBUG_COLLECTIVES", "1", 0);   /* read at the first collective */
    if (fsdp_runtime_init(&g_rank, &g_world) != FSDP_OK) {
        fprintf(stderr, "runtime init: %s\n", fsdp_last_error());
        return 1;
    }
    fsdp_comm *world = NULL;
    OK(fsdp_comm_world(&world));
    int s = g_world;
    still_in_step(world, s, "start");   /* collective #0 */

    if (g_world >= 2) {
        /* 1: rank 1 uses another label for the same gather. */
        fsdp_tensor *src = filled(FSDP_F32, 16, g_rank), *dst = filled(FSDP_F32, 16 * s, -1);
        fsdp_work *w = NULL;
        OK(fsdp_all_gather(&w, world, dst, src, g_rank == 1 ? "h.1" : "h.3"));
        fsdp_status st = fsdp_work_wait(w);
        char want[256];
        snprintf(want, sizeof want, "collective #1 on comm world(%d): rank 0 issued all_gather 'h.3' %d B f32 but "
                 "rank 1 issued all_gather 'h.1' %d B f32", s, 64 * s, 64 * s);
        const char *p1[] = {want};
        expect_mismatch(st, "label mismatch", p1, 1);
        OK(fsdp_work_free(w));
        float *v = malloc((size_t)(16 * s) * 4);
        OK(fsdp_tensor_to_data(dst, v, (int64_t)(16 * s) * 4));
        int untouched = 1;
        for (int i = 0; i < 16 * s; i++) untouched &= v[i] == -1.0f;
        check(untouched, "the mismatched gather must not run: dst[0] = %g", v[0]);
        free(v);
        still_in_step(world, s, "label mismatch");   /* #2 */

        /* 3: rank 1 gathers a different size (synchronous form). */
        fsdp_tensor *src2 = filled(FSDP_F32, g_rank == 1 ? 8 : 16, 1), *dst2 = filled(FSDP_F32, (g_rank == 1 ? 8 : 16) * s, 0);
        st = fsdp_all_gather(NULL, world, dst2, src2, "h.3");
        snprintf(want, sizeof want, "collective #3 on comm world(%d): rank 0 issued all_gather 'h.3' %d B f32 but "
                 "rank 1 issued all_gather 'h.3' %d B f32", s, 64 * s, 32 * s);
        const char *p2[] = {want};
        expect_mismatch(st, "size mismatch", p2, 1);
        still_in_step(world, s, "size mismatch");   /* #4 */

        /* 5: rank 1 reduce-scatters while the others gather. */
        fsdp_tensor *big = filled(FSDP_F32, 16 * s, 1), *small = filled(FSDP_F32, 16, 1);
        if (g_rank == 1) st = fsdp_reduce_scatter(NULL, world, small, big, FSDP_REDUCE_AVG, "h.1");
        else st = fsdp_all_gather(NULL, world, big, small, "h.3");
        snprintf(want, sizeof want, "collective #5 on comm world(%d): rank 0 issued all_gather 'h.3' %d B f32 but "
                 "rank 1 issued reduce_scatter 'h.1' %d B f32 avg", s, 64 * s, 64 * s);
        const char *p3[] = {want};
        expect_mismatch(st, "kind mismatch", p3, 1);
        still_in_step(world, s, "kind mismatch");

        /* On a split communicator: the last rank of a pair uses bf16. */
        fsdp_comm *pairs = NULL;
        OK(fsdp_comm_split(&pairs, world, g_rank / 2, g_rank));
        int pr = 0, ps = 1;
        OK(fsdp_comm_info(pairs, &pr, &ps));
        fsdp_tensor *t = filled(pr == 1 ? FSDP_BF16 : FSDP_F32, 10, 1);
        st = fsdp_all_reduce(NULL, pairs, t, FSDP_REDUCE_SUM, "grad");
        if (ps == 2) {
            const char *p4[] = {"collective #0 on comm world.split", "(2): rank 0 issued all_reduce 'grad' 40 B f32 sum",
                                "but rank 1 issued all_reduce 'grad' 20 B bf16 sum"};
            expect_mismatch(st, "dtype mismatch on a split", p4, 3);
        } else {
            check(st == FSDP_OK, "all_reduce on a communicator of one: %s", fsdp_last_error());
        }
        still_in_step(pairs, ps, "split mismatch");
        OK(fsdp_comm_free(pairs));
        fsdp_tensor *rel[] = {src, dst, src2, dst2, big, small, t};
        for (int k = 0; k < 7; k++) fsdp_tensor_release(rel[k]);
    } else {
        /* one rank has no peer to disagree with: in debug mode a gather
         * under any label, and a reduce-scatter, run and give their values */
        fsdp_tensor *src = filled(FSDP_F32, 5, 3.0), *dst = filled(FSDP_F32, 5, -1.0), *shard = filled(FSDP_F32, 5, 0);
        OK(fsdp_all_gather(NULL, world, dst, src, "h.1"));
        OK(fsdp_all_gather(NULL, world, dst, src, "h.3"));
        OK(fsdp_reduce_scatter(NULL, world, shard, dst, FSDP_REDUCE_SUM, "h.3"));
        float v[5] = {0}, r[5] = {0};
        OK(fsdp_tensor_to_data(dst, v, sizeof v));
        OK(fsdp_tensor_to_data(shard, r, sizeof r));
        int right = 1;
        for (int i = 0; i < 5; i++) right &= v[i] == 3.0f && r[i] == 3.0f;
        check(right, "one rank in debug mode: gathered %g, reduced %g, expected 3 and 3", v[0], r[0]);
        fsdp_tensor *rel[] = {src, dst, shard};
        for (int k = 0; k < 3; k++) fsdp_tensor_release(rel[k]);
        still_in_step(world, s, "one-rank collectives");
    }

    double tot = (double)g_local_fail;
    if (fsdp_all_reduce_doubles(world, &tot, 1, FSDP_REDUCE_SUM) != FSDP_OK) {
        fprintf(stderr, "rank %d: final all_reduce_doubles: %s\n", g_rank, fsdp_last_error());
        tot += 1;
    }
    OK(fsdp_comm_free(world));
    int code = tot == 0 ? 0 : 1;
    if (g_rank == 0) {
        int c0 = test_summary();
        if (c0) code = 1;
    }
    fsdp_runtime_finalize();
    return code;
}
