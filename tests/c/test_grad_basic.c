/* Finite-difference gradient checks for arithmetic, reductions, matmul,
 * views and casts, and the tape's accumulation rules. */
#include "fsdp.h"
#include "gradcheck.h"
#include "testutil.h"
#include <math.h>
#include <string.h>

#define EPS 1e-2
#define TOL 1e-2   /* |analytic - numeric| <= TOL * max(1, |numeric|); f32 forward, double sums */

static fsdp_status f_binary(fsdp_tensor **out, fsdp_tensor **in, void *ctx) {
    return fsdp_binary(out, *(int *)ctx, in[0], in[1]);
}
static fsdp_status f_scale(fsdp_tensor **out, fsdp_tensor **in, void *ctx) {
    (void)ctx;
    return fsdp_scale(out, in[0], -1.75);
}
static fsdp_status f_add_scalar(fsdp_tensor **out, fsdp_tensor **in, void *ctx) {
    (void)ctx;
    return fsdp_add_scalar(out, in[0], 0.5);
}
typedef struct { int n; int dims[4]; int keep; int mean; } red_ctx;
static fsdp_status f_reduce(fsdp_tensor **out, fsdp_tensor **in, void *ctx) {
    red_ctx *c = ctx;
    return c->mean ? fsdp_mean(out, in[0], c->n, c->dims, c->keep) : fsdp_sum(out, in[0], c->n, c->dims, c->keep);
}
typedef struct { int ta, tb; } mm_ctx;
static fsdp_status f_matmul(fsdp_tensor **out, fsdp_tensor **in, void *ctx) {
    mm_ctx *c = ctx;
    return fsdp_matmul(out, in[0], in[1], c->ta, c->tb);
}
/* a chain of views ending in a computation, so the grads pass through views */
static fsdp_status f_views(fsdp_tensor **out, fsdp_tensor **in, void *ctx) {
    (void)ctx;
    fsdp_tensor *p, *n, *r, *e;
    int perm[3] = {2, 0, 1};
    fsdp_permute(&p, in[0], 3, perm);                    /* (2,3,5) -> (5,2,3) */
    fsdp_narrow(&n, p, 0, 1, 3);                          /* (3,2,3) */
    int64_t shape[2] = {3, 6};
    fsdp_status st = fsdp_reshape(&r, n, 2, shape);       /* not viewable: copies */
    int64_t eshape[3] = {4, 3, 6};
    if (st == FSDP_OK) st = fsdp_expand(&e, r, 3, eshape);
    if (st == FSDP_OK) {
        st = fsdp_mul(out, e, e);
        fsdp_tensor_release(e);
    }
    fsdp_tensor_release(p);
    fsdp_tensor_release(n);
    fsdp_tensor_release(r);
    return st;
}
static fsdp_status f_transpose_contig(fsdp_tensor **out, fsdp_tensor **in, void *ctx) {
    (void)ctx;
    fsdp_tensor *t, *c;
    fsdp_transpose(&t, in[0], 0, 1);
    fsdp_status st = fsdp_contiguous(&c, t);
    fsdp_tensor_release(t);
    if (st != FSDP_OK) return st;
    st = fsdp_mul(out, c, in[1]);
    fsdp_tensor_release(c);
    return st;
}
static fsdp_status f_cast(fsdp_tensor **out, fsdp_tensor **in, void *ctx) {
    (void)ctx;
    fsdp_tensor *b, *b2;
    fsdp_cast(&b, in[0], FSDP_BF16);
    fsdp_status st = fsdp_mul(&b2, b, b);
    fsdp_tensor_release(b);
    if (st != FSDP_OK) return st;
    st = fsdp_cast(out, b2, FSDP_F32);
    fsdp_tensor_release(b2);
    return st;
}

static gc_spec spec2(int nda, const int64_t *sa, int ndb, const int64_t *sb) {
    gc_spec s;
    memset(&s, 0, sizeof s);
    s.n_in = ndb ? 2 : 1;
    s.ndim[0] = nda;
    memcpy(s.shape[0], sa, sizeof(int64_t) * (size_t)nda);
    s.differentiable[0] = 1;
    if (ndb) {
        s.ndim[1] = ndb;
        memcpy(s.shape[1], sb, sizeof(int64_t) * (size_t)ndb);
        s.differentiable[1] = 1;
    }
    return s;
}

static void check_binary(void) {
    struct { int nda; int64_t a[3]; int ndb; int64_t b[3]; } cases[] = {
        {2, {3, 5}, 2, {3, 5}},      /* same shape */
        {2, {3, 5}, 1, {5}},         /* row */
        {2, {3, 5}, 2, {3, 1}},      /* column */
        {3, {2, 1, 7}, 2, {3, 1}},   /* both broadcast */
        {1, {1}, 2, {2, 3}},         /* scalar-like */
        {3, {2, 3, 1}, 3, {1, 3, 4}},
    };
    const char *names[] = {"add", "sub", "mul", "div"};
    for (int op = 0; op < 4; op++)
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            gc_spec s = spec2(cases[c].nda, cases[c].a, cases[c].ndb, cases[c].b);
            char name[64];
            snprintf(name, sizeof name, "%s case %zu", names[op], c);
            gradcheck(name, f_binary, &op, &s, 100 + (unsigned)c, EPS, op == 3 ? 3 * TOL : TOL);
        }
}

static void check_reduce(void) {
    int64_t sh[3] = {3, 4, 5};
    red_ctx cases[] = {{0, {0}, 0, 0}, {1, {1}, 0, 0}, {2, {0, 2}, 1, 0}, {1, {-1}, 1, 1}, {0, {0}, 0, 1},
                       {2, {0, 1}, 0, 1}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        gc_spec s = spec2(3, sh, 0, NULL);
        char name[64];
        snprintf(name, sizeof name, "%s case %zu", cases[c].mean ? "mean" : "sum", c);
        gradcheck(name, f_reduce, &cases[c], &s, 7 + (unsigned)c, EPS, TOL);
    }
    gc_spec s = spec2(3, sh, 0, NULL);
    gradcheck("scale", f_scale, NULL, &s, 1, EPS, TOL);
    gradcheck("add_scalar", f_add_scalar, NULL, &s, 2, EPS, TOL);
}

static void check_matmul(void) {
    const int64_t M = 5, K = 7, N = 3, B = 2;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int kind = 0; kind < 3; kind++) {   /* 2-D, batched, batched a with shared b */
                int64_t a2[2] = {ta ? K : M, ta ? M : K}, b2[2] = {tb ? N : K, tb ? K : N};
                int64_t a3[3] = {B, a2[0], a2[1]}, b3[3] = {B, b2[0], b2[1]};
                gc_spec s = kind == 0 ? spec2(2, a2, 2, b2) : kind == 1 ? spec2(3, a3, 3, b3) : spec2(3, a3, 2, b2);
                mm_ctx c = {ta, tb};
                char name[64];
                snprintf(name, sizeof name, "matmul ta=%d tb=%d kind=%d", ta, tb, kind);
                gradcheck(name, f_matmul, &c, &s, 31 + (unsigned)(ta * 6 + tb * 3 + kind), EPS, TOL);
            }
}

static void check_views_cast(void) {
    int64_t sh[3] = {2, 3, 5};
    gc_spec s = spec2(3, sh, 0, NULL);
    gradcheck("views", f_views, NULL, &s, 3, EPS, TOL);
    int64_t a[2] = {4, 3}, b[2] = {3, 4};
    gc_spec s2 = spec2(2, a, 2, b);
    gradcheck("transpose+contiguous", f_transpose_contig, NULL, &s2, 4, EPS, TOL);
    gc_spec s3 = spec2(2, a, 0, NULL);
    /* bf16 rounds the forward: a looser tolerance and a larger step */
    gradcheck("cast bf16", f_cast, NULL, &s3, 5, 5e-2, 5e-2);
}

/* x used twice, and grads accumulating over two backward passes */
static void check_tape_rules(void) {
    int64_t sh[1] = {3};
    float xv[3] = {1.5f, -2.0f, 0.25f};
    fsdp_tensor *x = gc_tensor(1, sh, xv), *y, *z, *s, *g;
    fsdp_tensor_set_requires_grad(x, 1);
    for (int pass = 0; pass < 2; pass++) {
        fsdp_mul(&y, x, x);
        fsdp_add(&z, y, x);              /* z = x^2 + x */
        fsdp_sum(&s, z, 0, NULL, 0);
        int id;
        test_check(fsdp_backward_begin(s, NULL) == FSDP_OK, "backward_begin: %s", fsdp_last_error());
        do fsdp_backward_step(&id); while (id != -1);
        fsdp_tensor_release(y);
        fsdp_tensor_release(z);
        fsdp_tensor_release(s);
    }
    fsdp_tensor_grad(x, &g);
    float gv[3];
    fsdp_tensor_to_data(g, gv, sizeof gv);
    double want[3];
    for (int i = 0; i < 3; i++) want[i] = 2 * (2.0 * xv[i] + 1);   /* two passes */
    test_compare("accumulated grad of x^2+x", gv, want, 3, 1e-6, 1e-6);
    int64_t n;
    fsdp_tape_size(&n);
    test_check(n == 0, "tape empty after backward (%lld nodes)", (long long)n);
    /* no-grad and detach record nothing */
    int prev;
    fsdp_set_grad_enabled(0, &prev);
    fsdp_mul(&y, x, x);
    fsdp_set_grad_enabled(prev, NULL);
    int rg;
    fsdp_tensor_requires_grad(y, &rg);
    fsdp_tape_size(&n);
    test_check(rg == 0 && n == 0, "no_grad: output requires_grad %d, tape %lld", rg, (long long)n);
    fsdp_tensor_release(y);
    fsdp_detach(&z, x);
    fsdp_mul(&y, z, z);
    fsdp_tensor_requires_grad(y, &rg);
    test_check(rg == 0, "detach cuts the tape");
    fsdp_tensor_release(y);
    fsdp_tensor_release(z);
    /* backward of a non-scalar without a gradient is an error, and the engine goes on */
    fsdp_mul(&y, x, x);
    fsdp_status st = fsdp_backward_begin(y, NULL);
    test_check(st == FSDP_ERR_SHAPE && strstr(fsdp_last_error(), "not a scalar"), "non-scalar backward: %s",
               fsdp_last_error());
    fsdp_tape_clear();
    fsdp_tensor_release(y);
    fsdp_tensor_release(g);
    fsdp_tensor_release(x);
}

/* Lua-defined ops: the walk pauses on them and resumes */
static void check_custom(void) {
    int64_t sh[1] = {4};
    float xv[4] = {1, 2, -3, 0.5f};
    fsdp_tensor *x = gc_tensor(1, sh, xv), *y, *z, *s;
    fsdp_tensor_set_requires_grad(x, 1);
    fsdp_scale(&y, x, 3.0);
    /* pretend z = y^2 was computed elsewhere */
    int prev;
    fsdp_set_grad_enabled(0, &prev);
    fsdp_mul(&z, y, y);
    fsdp_set_grad_enabled(prev, NULL);
    test_check(fsdp_custom_record(7, 1, &y, 1, &z) == FSDP_OK, "custom_record: %s", fsdp_last_error());
    fsdp_sum(&s, z, 0, NULL, 0);
    fsdp_backward_begin(s, NULL);
    int id, pauses = 0;
    for (;;) {
        test_check(fsdp_backward_step(&id) == FSDP_OK, "backward_step: %s", fsdp_last_error());
        if (id == -1) break;
        pauses++;
        test_check(id == 7, "paused on custom op 7 (got %d)", id);
        fsdp_tensor *gz, *t, *gy;
        fsdp_custom_grad_output(0, &gz);
        fsdp_mul(&t, gz, y);
        fsdp_scale(&gy, t, 2.0);
        test_check(fsdp_custom_add_grad_input(0, gy) == FSDP_OK, "custom_add_grad_input: %s", fsdp_last_error());
        fsdp_tensor_release(gz);
        fsdp_tensor_release(t);
        fsdp_tensor_release(gy);
    }
    test_check(pauses == 1, "one pause (%d)", pauses);
    fsdp_tensor *g;
    float gv[4];
    double want[4];
    fsdp_tensor_grad(x, &g);
    fsdp_tensor_to_data(g, gv, sizeof gv);
    for (int i = 0; i < 4; i++) want[i] = 18.0 * xv[i];   /* d/dx (3x)^2 */
    test_compare("custom op gradient", gv, want, 4, 1e-5, 1e-6);
    fsdp_tensor_release(g);
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);
    fsdp_tensor_release(z);
    fsdp_tensor_release(s);
}

/* Gradients that reach two tensors from one buffer (add without
 * broadcasting) must not share an accumulator: a = 2x, b = 3x, e = 5a,
 * loss = sum(a + b) + sum(e): dloss/dx = 2 (1 + 5) + 3 = 15. */
static void check_no_shared_accumulators(void) {
    int64_t sh[1] = {2};
    float xv[2] = {1, -1};
    fsdp_tensor *x = gc_tensor(1, sh, xv), *a, *b, *e, *ab, *s1, *s2, *loss, *g;
    fsdp_tensor_set_requires_grad(x, 1);
    fsdp_scale(&a, x, 2.0);
    fsdp_scale(&b, x, 3.0);
    fsdp_scale(&e, a, 5.0);
    fsdp_add(&ab, a, b);
    fsdp_sum(&s1, ab, 0, NULL, 0);
    fsdp_sum(&s2, e, 0, NULL, 0);
    fsdp_add(&loss, s1, s2);
    int id;
    fsdp_backward_begin(loss, NULL);
    do fsdp_backward_step(&id); while (id != -1);
    fsdp_tensor_grad(x, &g);
    float gv[2];
    double want[2] = {15, 15};
    fsdp_tensor_to_data(g, gv, sizeof gv);
    test_compare("gradient through add feeding two consumers", gv, want, 2, 0, 1e-6);
    fsdp_tensor *all[] = {x, a, b, e, ab, s1, s2, loss, g};
    for (int k = 0; k < 9; k++) fsdp_tensor_release(all[k]);
    /* a .grad must be contiguous, of the tensor's dtype */
    int64_t sq[2] = {4, 4}, row[2] = {1, 4};
    float z[16] = {0};
    fsdp_tensor *w = gc_tensor(2, sq, z), *r = gc_tensor(2, row, z), *ex;
    fsdp_expand(&ex, r, 2, sq);
    test_check(fsdp_tensor_set_grad(w, ex) == FSDP_ERR_LAYOUT, "an expanded .grad is refused: %s", fsdp_last_error());
    fsdp_tensor_release(w);
    fsdp_tensor_release(r);
    fsdp_tensor_release(ex);
}

int main(void) {
    check_no_shared_accumulators();
    check_binary();
    check_reduce();
    check_matmul();
    check_views_cast();
    check_tape_rules();
    check_custom();
    return test_summary();
}
