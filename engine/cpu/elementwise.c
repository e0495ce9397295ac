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

/* bf16 rows: each element widened as it is loaded (a shift), the result
 * rounded once as it is stored; the compiler vectorizes both. */
#define DEF_ROWS16(name, EXPR)                                                                     \
    static void name##16_vv(uint16_t *o, const uint16_t *a, const uint16_t *b, int64_t n) {       \
        for (int64_t i = 0; i < n; i++) {                                                          \
            float x = bf16_to_f32(a[i]), y = bf16_to_f32(b[i]);                                    \
            o[i] = f32_to_bf16(EXPR);                                                              \
        }                                                                                          \
    }                                                                                              \
    static void name##16_vs(uint16_t *o, const uint16_t *a, float y, int64_t n) {                 \
        for (int64_t i = 0; i < n; i++) { float x = bf16_to_f32(a[i]); o[i] = f32_to_bf16(EXPR); } \
    }                                                                                              \
    static void name##16_sv(uint16_t *o, float x, const uint16_t *b, int64_t n) {                 \
        for (int64_t i = 0; i < n; i++) { float y = bf16_to_f32(b[i]); o[i] = f32_to_bf16(EXPR); } \
    }                                                                                              \
    static void name##16_ss(uint16_t *o, const uint16_t *a, int64_t sa, const uint16_t *b, int64_t sb, int64_t n) { \
        for (int64_t i = 0; i < n; i++) {                                                          \
            float x = bf16_to_f32(a[i * sa]), y = bf16_to_f32(b[i * sb]);                          \
            o[i] = f32_to_bf16(EXPR);                                                              \
        }                                                                                          \
    }
DEF_ROWS16(add, x + y)
DEF_ROWS16(sub, x - y)
DEF_ROWS16(mul, x * y)
DEF_ROWS16(div, x / y)
#undef DEF_ROWS16

typedef struct {
    void (*vv)(uint16_t *, const uint16_t *, const uint16_t *, int64_t);
    void (*vs)(uint16_t *, const uint16_t *, float, int64_t);
    void (*sv)(uint16_t *, float, const uint16_t *, int64_t);
    void (*ss)(uint16_t *, const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t);
} row_ops16;

static const row_ops16 OPS16[4] = {
    {add16_vv, add16_vs, add16_sv, add16_ss},
    {sub16_vv, sub16_vs, sub16_sv, sub16_ss},
    {mul16_vv, mul16_vs, mul16_sv, mul16_ss},
    {div16_vv, div16_vs, div16_sv, div16_ss},
};

static void do_row16(const row_ops16 *op, uint16_t *o, const uint16_t *a, int64_t sa, const uint16_t *b, int64_t sb,
                     int64_t n) {
    if (sa == 1 && sb == 1) op->vv(o, a, b, n);
    else if (sa == 1 && sb == 0) op->vs(o, a, bf16_to_f32(*b), n);
    else if (sa == 0 && sb == 1) op->sv(o, bf16_to_f32(*a), b, n);
    else op->ss(o, a, sa, b, sb, n);
}

/* The merged problem; pointers are bytes, es the element size (4 or 2). */
typedef struct {
    int op;
    int bf16;
    size_t es;
    char *out;
    const char *a, *b;
    int ndim;                         /* merged dims, >= 1 */
    int64_t shape[MAXD], sa[MAXD], sb[MAXD];
} binary_plan;

static void plan_row(const binary_plan *c, char *o, const char *a, int64_t sa, const char *b, int64_t sb, int64_t n) {
    if (c->bf16)
        do_row16(&OPS16[c->op], (uint16_t *)o, (const uint16_t *)a, sa, (const uint16_t *)b, sb, n);
    else
        do_row(&OPS[c->op], (float *)o, (const float *)a, sa, (const float *)b, sb, n);
}

/* A 1-d problem split by elements: offsets move a and b along their stride. */
static void binary_1d(void *p, int64_t begin, int64_t end) {
    const binary_plan *c = p;
    size_t es = c->es;
    plan_row(c, c->out + begin * es, c->a + begin * c->sa[0] * es, c->sa[0], c->b + begin * c->sb[0] * es, c->sb[0],
             end - begin);
}

/* Rows [begin, end) over the outer dims, with an index counter. */
static void binary_rows(void *p, int64_t begin, int64_t end) {
    const binary_plan *c = p;
    size_t es = c->es;
    int outer = c->ndim - 1;
    int64_t n = c->shape[outer];
    int64_t idx[MAXD];
    const char *a = c->a, *b = c->b;
    int64_t rem = begin;
    for (int k = outer - 1; k >= 0; k--) {
        idx[k] = rem % c->shape[k];
        rem /= c->shape[k];
        a += idx[k] * c->sa[k] * es;
        b += idx[k] * c->sb[k] * es;
    }
    char *o = c->out + begin * n * es;
    for (int64_t r = begin; r < end; r++, o += n * es) {
        plan_row(c, o, a, c->sa[outer], b, c->sb[outer], n);
        for (int k = outer - 1; k >= 0; k--) {   /* odometer step */
            a += c->sa[k] * es;
            b += c->sb[k] * es;
            if (++idx[k] < c->shape[k]) break;
            a -= idx[k] * c->sa[k] * es;
            b -= idx[k] * c->sb[k] * es;
            idx[k] = 0;
        }
    }
}

static void binary_any(int op, int bf16, void *out, const void *a, const int64_t *a_strides, const void *b,
                       const int64_t *b_strides, int ndim, const int64_t *shape) {
    if (op < 0 || op > 3) return;   /* the op layer checks */
    binary_plan c = {.op = op, .bf16 = bf16, .es = bf16 ? 2 : 4, .out = out, .a = a, .b = b};
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

void cpu_binary_f32(int op, float *out, const float *a, const int64_t *a_strides,
                    const float *b, const int64_t *b_strides, int ndim, const int64_t *shape) {
    binary_any(op, 0, out, a, a_strides, b, b_strides, ndim, shape);
}

void cpu_binary_bf16(int op, uint16_t *out, const uint16_t *a, const int64_t *a_strides,
                     const uint16_t *b, const int64_t *b_strides, int ndim, const int64_t *shape) {
    binary_any(op, 1, out, a, a_strides, b, b_strides, ndim, shape);
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

/* y (f32) += alpha * x (bf16): x widened in registers (a bf16 value is the
 * top half of its f32), one FMA per element */
typedef struct { float *y; const uint16_t *x; float alpha; } axpy16_ctx;

static void axpy_f32_bf16_range(void *p, int64_t begin, int64_t end) {
    const axpy16_ctx *c = p;
    float *restrict y = c->y;
    const uint16_t *restrict x = c->x;
    const float alpha = c->alpha;
    for (int64_t i = begin; i < end; i++) y[i] += alpha * bf16_to_f32(x[i]);
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

void cpu_axpy_f32_bf16(float *y, const uint16_t *x, float alpha, int64_t n) {
    axpy16_ctx c = {y, x, alpha};
    cpu_parallel_for(n, EW_GRAIN, axpy_f32_bf16_range, &c);
}
