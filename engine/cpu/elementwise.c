/* elementwise.c: out = a op b with broadcasting, and the scalar/axpy loops.
 * out is contiguous; a and b are read through strides that are 0 along
 * broadcast dims. After dropping size-1 dims and merging dims that are
 * contiguous in out, a and b alike, almost every call falls into a loop over
 * rows where a's and b's row is each either contiguous or one scalar:
 *   same shape          -> one row of n, both contiguous
 *   b scalar            -> one row, b scalar
 *   bias add (.., C)+(C)-> rows of C, b's row pointer repeats
 *   column (M, N)+(M,1) -> rows of N, b scalar per row
 * Other strides go through a general strided row. Rows are split over the
 * thread pool; loops are plain so the compiler vectorizes them. */
#include "cpu_kernels.h"
#include "fsdp.h"

#define EW_GRAIN (1 << 15)   /* elements per thread chunk */
#define MAXD 16

/* ---- one row of n: vector-vector, vector-scalar, scalar-vector, strided ---- */
/* No restrict: out may alias a or b (in-place ops); the compiler versions the
 * loop on a runtime overlap check and still vectorizes. */
#define DEF_ROWS(name, EXPR)                                                                       \
    static void name##_vv(float *o, const float *a, const float *b, int64_t n) {                  \
        for (int64_t i = 0; i < n; i++) { float x = a[i], y = b[i]; o[i] = EXPR; }                \
    }                                                                                              \
    static void name##_vs(float *o, const float *a, float y, int64_t n) {                         \
        for (int64_t i = 0; i < n; i++) { float x = a[i]; o[i] = EXPR; }                          \
    }                                                                                              \
    static void name##_sv(float *o, float x, const float *b, int64_t n) {                         \
        for (int64_t i = 0; i < n; i++) { float y = b[i]; o[i] = EXPR; }                          \
    }                                                                                              \
    static void name##_ss(float *o, const float *a, int64_t sa, const float *b, int64_t sb, int64_t n) { \
        for (int64_t i = 0; i < n; i++) { float x = a[i * sa], y = b[i * sb]; o[i] = EXPR; }      \
    }
DEF_ROWS(add, x + y)
DEF_ROWS(sub, x - y)
DEF_ROWS(mul, x * y)
DEF_ROWS(div, x / y)
#undef DEF_ROWS

typedef struct {
    void (*vv)(float *, const float *, const float *, int64_t);
    void (*vs)(float *, const float *, float, int64_t);
    void (*sv)(float *, float, const float *, int64_t);
    void (*ss)(float *, const float *, int64_t, const float *, int64_t, int64_t);
} row_ops;

static const row_ops OPS[4] = {
    {add_vv, add_vs, add_sv, add_ss},
    {sub_vv, sub_vs, sub_sv, sub_ss},
    {mul_vv, mul_vs, mul_sv, mul_ss},
    {div_vv, div_vs, div_sv, div_ss},
};

static void do_row(const row_ops *op, float *o, const float *a, int64_t sa, const float *b, int64_t sb, int64_t n) {
    if (sa == 1 && sb == 1) op->vv(o, a, b, n);
    else if (sa == 1 && sb == 0) op->vs(o, a, *b, n);
    else if (sa == 0 && sb == 1) op->sv(o, *a, b, n);
    else op->ss(o, a, sa, b, sb, n);
}

typedef struct {
    const row_ops *op;
    float *out;
    const float *a, *b;
    int ndim;                         /* merged dims, >= 1 */
    int64_t shape[MAXD], sa[MAXD], sb[MAXD];
} binary_plan;

/* A 1-d problem split by elements: offsets move a and b along their stride. */
static void binary_1d(void *p, int64_t begin, int64_t end) {
    const binary_plan *c = p;
    do_row(c->op, c->out + begin, c->a + begin * c->sa[0], c->sa[0], c->b + begin * c->sb[0], c->sb[0],
           end - begin);
}

/* Rows [begin, end) over the outer dims, with an index counter. */
static void binary_rows(void *p, int64_t begin, int64_t end) {
    const binary_plan *c = p;
    int outer = c->ndim - 1;
    int64_t n = c->shape[outer];
    int64_t idx[MAXD];
    const float *a = c->a, *b = c->b;
    int64_t rem = begin;
    for (int k = outer - 1; k >= 0; k--) {
        idx[k] = rem % c->shape[k];
        rem /= c->shape[k];
        a += idx[k] * c->sa[k];
        b += idx[k] * c->sb[k];
    }
    float *o = c->out + begin * n;
    for (int64_t r = begin; r < end; r++, o += n) {
        do_row(c->op, o, a, c->sa[outer], b, c->sb[outer], n);
        for (int k = outer - 1; k >= 0; k--) {   /* odometer step */
            a += c->sa[k];
            b += c->sb[k];
            if (++idx[k] < c->shape[k]) break;
            a -= idx[k] * c->sa[k];
            b -= idx[k] * c->sb[k];
            idx[k] = 0;
        }
    }
}

void cpu_binary_f32(int op, float *out, const float *a, const int64_t *a_strides,
                    const float *b, const int64_t *b_strides, int ndim, const int64_t *shape) {
    if (op < 0 || op > 3) return;   /* the op layer checks */
    binary_plan c = {.op = &OPS[op], .out = out, .a = a, .b = b};
    int64_t numel = 1;
    int nd = 0;
    for (int k = 0; k < ndim; k++) {
        numel *= shape[k];
        if (shape[k] == 1) continue;
        /* out is contiguous, so a dim merges into the previous one when a and
         * b also step over it exactly (contiguous or both broadcast) */
        if (nd > 0 && c.sa[nd - 1] == a_strides[k] * shape[k] && c.sb[nd - 1] == b_strides[k] * shape[k]) {
            c.shape[nd - 1] *= shape[k];
            c.sa[nd - 1] = a_strides[k];
            c.sb[nd - 1] = b_strides[k];
            continue;
        }
        if (nd == MAXD) return;   /* unreachable for the engine's 8 dims */
        c.shape[nd] = shape[k];
        c.sa[nd] = a_strides[k];
        c.sb[nd] = b_strides[k];
        nd++;
    }
    if (numel <= 0) return;
    if (nd == 0) {   /* one element */
        c.shape[0] = 1;
        c.sa[0] = c.sb[0] = 0;
        nd = 1;
    }
    c.ndim = nd;
    if (nd == 1) {
        cpu_parallel_for(numel, EW_GRAIN, binary_1d, &c);
        return;
    }
    int64_t n = c.shape[nd - 1];
    cpu_parallel_for(numel / n, EW_GRAIN / n + 1, binary_rows, &c);
}

/* ---- scalar and axpy ---- */
typedef struct { float *out; const float *a; float s; } scalar_ctx;

static void scale_range(void *p, int64_t begin, int64_t end) {
    scalar_ctx *c = p;
    mul_vs(c->out + begin, c->a + begin, c->s, end - begin);
}
static void add_scalar_range(void *p, int64_t begin, int64_t end) {
    scalar_ctx *c = p;
    add_vs(c->out + begin, c->a + begin, c->s, end - begin);
}
static void axpy_range(void *p, int64_t begin, int64_t end) {
    scalar_ctx *c = p;
    float *y = c->out;
    const float *x = c->a;
    float alpha = c->s;
    for (int64_t i = begin; i < end; i++) y[i] += alpha * x[i];
}

void cpu_scale_f32(float *out, const float *a, float s, int64_t n) {
    scalar_ctx c = {out, a, s};
    cpu_parallel_for(n, EW_GRAIN, scale_range, &c);
}

void cpu_add_scalar_f32(float *out, const float *a, float s, int64_t n) {
    scalar_ctx c = {out, a, s};
    cpu_parallel_for(n, EW_GRAIN, add_scalar_range, &c);
}

void cpu_axpy_f32(float *y, const float *x, float alpha, int64_t n) {
    scalar_ctx c = {y, x, alpha};
    cpu_parallel_for(n, EW_GRAIN, axpy_range, &c);
}
