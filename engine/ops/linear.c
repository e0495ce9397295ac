/* linear.c: a Linear layer as one op (after llm.c):
 *
 *   fsdp_linear  y = [res +] act(x W^T + bias)      x (..., in), W (out, in), bias (out), res like y
 *
 * On a device whose table has matmul_epilogue_bf16 (cuBLASLt on CUDA), bf16
 * tensors with a bias take one GEMM with an epilogue each way:
 *   forward   BIAS (res as the GEMM's C, beta 1) or GELU_AUX_BIAS (aux = the
 *             pre-activation, saved for the backward; GELU_BIAS, no aux,
 *             when the tape records nothing: evaluation, sampling)
 *   backward  dpre = dy, or dy gelu'(aux) (one elementwise pass);
 *             dx (M, in) = dpre (M, out) W (out, in);
 *             dW (out, in) = dpre^T x, with BGRAD_A giving dbias = the column
 *             sums of dpre in the same GEMM; dres = dy itself (shared, as an
 *             add shares its gradient).
 * Everywhere else (the CPU, f32, no bias, gelu with res, the entry returning
 * 0) the op is the composition it replaces: fsdp_matmul, then fsdp_bias_gelu,
 * fsdp_bias_residual or the unfused ops, node for node, so values and speed
 * there do not change.
 *
 *   fsdp_mlp     y = [res +] gelu(x W_fc^T + b_fc) W_proj^T + b_proj   (GPT-2's MLP)
 *
 * Both Linears in one node, so that the GELU's backward can ride on c_proj's
 * dx GEMM: d pre = (dy W_proj) gelu'(aux) with c_fc's bias gradient from the
 * same GEMM (DGELU_BGRAD), where two nodes would write d h and read it back
 * for the GELU backward. Forward: GELU_AUX_BIAS, then BIAS (res as C); it
 * saves aux and h, as the two Linears do. Elsewhere: two fsdp_linear. */
#include "ops_util.h"
#include "trace.h"
#include "device.h"
#include "reduce_shape.h"

/* node->in of the fused node; node->i[0] the activation, i[1] whether res is an input */
enum { LIN_X, LIN_W, LIN_B, LIN_RES };

typedef struct {
    int64_t M, N, K;   /* rows of x, out, in */
} lin_dims;

static lin_dims dims_of(const fsdp_tensor *x, const fsdp_tensor *w) {
    lin_dims d = {0, w->shape[0], w->shape[1]};
    d.M = d.K ? tensor_numel(x) / d.K : 0;
    if (!d.K) {   /* rows are the leading dims even when in is 0 */
        d.M = 1;
        for (int k = 0; k < x->ndim - 1; k++) d.M *= x->shape[k];
    }
    return d;
}

/* ---- the bias gradient ---- */

/* Where the bias gradient (N) goes: straight into the .grad the bias has
 * (an FSDP unit's slice; *write: its first gradient, so it may be written
 * as it is), else a new tensor for the tape (*fresh). */
typedef struct {
    fsdp_tensor *grad;    /* the .grad written or added to (not retained), or NULL */
    fsdp_tensor *fresh;   /* a new tensor to give the bias (owned), or NULL */
    bool write;           /* grad is unwritten: the epilogue writes it itself */
} bias_grad;

static fsdp_status bias_grad_open(fsdp_node *node, int i, int64_t N, bias_grad *bg) {
    bg->grad = bg->fresh = NULL;
    bg->write = false;
    float beta = 1.0f;
    bg->grad = node_grad_target(node, i, FSDP_BF16, &beta);   /* claims an unwritten .grad: it is written below */
    bg->write = bg->grad && beta == 0.0f;
    if (bg->grad && bg->write) return FSDP_OK;
    /* a new gradient, or one to add through a temporary (the epilogue writes, never adds) */
    return op_new_as(&bg->fresh, FSDP_BF16, 1, &N);
}

/* Where the epilogue writes the column sums. */
static uint16_t *bias_grad_dst(const bias_grad *bg) {
    return bg->write ? tensor_data(bg->grad) : tensor_data(bg->fresh);
}

/* The column sums of dpre (M, N) without the epilogue, into the same place. */
static void bias_grad_sum(const bias_grad *bg, const fsdp_tensor *dpre, int64_t M, int64_t N) {
    const fsdp_device_kernels *k = KERNELS(dpre);
    if (bg->grad && !bg->write && k->sum_dim_acc_bf16) {   /* added in one pass, one rounding */
        k->sum_dim_acc_bf16(tensor_data(bg->grad), tensor_data(dpre), 1, M, N);
        return;
    }
    k->sum_dim_bf16(bias_grad_dst(bg), tensor_data(dpre), 1, M, N);
}

/* The sums written: added into a .grad that held a gradient, or given to the bias. */
static fsdp_status bias_grad_close(fsdp_node *node, int i, bias_grad *bg, bool summed_into_grad) {
    fsdp_status st = FSDP_OK;
    if (bg->grad && !bg->write && !summed_into_grad)
        KERNELS(bg->grad)->axpy_bf16(tensor_data(bg->grad), tensor_data(bg->fresh), 1.0f, tensor_numel(bg->fresh));
    else if (!bg->grad && bg->fresh) {
        st = op_give_grad(node, i, bg->fresh);
        bg->fresh = NULL;
    }
    tensor_release(bg->fresh);
    bg->fresh = NULL;
    return st;
}

/* Frees what bias_grad_open made; st: how the backward went. On an error,
 * a .grad it claimed (cleared its unwritten mark) gets the mark back: its
 * memory may hold an unzeroed flat gradient's garbage, and with the mark
 * the next backward writes it (or the unit zeroes it) instead of adding
 * into it. */
static void bias_grad_drop(bias_grad *bg, fsdp_status st) {
    if (st != FSDP_OK && bg->grad && bg->write) bg->grad->unwritten = true;
    bg->write = false;
    tensor_release(bg->fresh);
    bg->fresh = NULL;
}

/* ---- the weight gradient (and the bias's, riding on it) ---- */

/* dW (N, K) = dpre^T (N, M) x (M, K), written into W's .grad when it has one
 * (beta 0 when unwritten, 1 to add), else given to W; with want_b, the
 * bias gradient from the same GEMM (BGRAD_A: row sums of op(A) = dpre^T),
 * or from a column sum when the device does not fuse it. */
static fsdp_status weight_grads(fsdp_node *node, int iw, int ib, const fsdp_tensor *dpre, const fsdp_tensor *xs,
                                lin_dims d) {
    const fsdp_device_kernels *k = KERNELS(dpre);
    bool want_w = node_needs_grad(node, iw), want_b = ib >= 0 && node_needs_grad(node, ib);
    if (!want_w && !want_b) return FSDP_OK;
    bias_grad bg = {0};
    fsdp_status st = FSDP_OK;
    bool fused_b = false, summed_into_grad = false;
    fsdp_tensor *acc = NULL, *gw = NULL;
    float beta = 0.0f;
    if (want_w) {   /* W's gradient first: the bias's .grad is claimed only when nothing before its write can fail */
        acc = node_grad_target(node, iw, FSDP_BF16, &beta);
        if (acc) {
            tensor_retain(acc);
            gw = acc;
        } else {
            FSDP_TRY(op_new_as(&gw, FSDP_BF16, 2, node->in[iw]->shape));
        }
    }
    if (want_b && (st = bias_grad_open(node, ib, d.N, &bg)) != FSDP_OK) {
        if (acc && beta == 0.0f) acc->unwritten = true;   /* claimed, not written: as bias_grad_drop does */
        tensor_release(gw);
        return st;
    }
    if (want_w) {
        uint16_t *W = tensor_data(gw);
        if (want_b)
            fused_b = k->matmul_epilogue_bf16(W, tensor_data(dpre), tensor_data(xs), W, d.N, d.K, d.M, 1, 0, 1.0f,
                                              beta, FSDP_EPILOGUE_BGRAD_A, NULL, NULL, bias_grad_dst(&bg)) != 0;
        if (!fused_b)
            k->matmul_bf16(W, tensor_data(dpre), tensor_data(xs), 1, d.N, d.K, d.M, 1, 0, 1.0f, beta, 0, 0, 0);
        if (acc) tensor_release(gw);
        else st = op_give_grad(node, iw, gw);
    }
    if (want_b && !fused_b) {
        bias_grad_sum(&bg, dpre, d.M, d.N);
        summed_into_grad = bg.grad && !bg.write && k->sum_dim_acc_bf16;
    }
    if (want_b && st == FSDP_OK) st = bias_grad_close(node, ib, &bg, summed_into_grad);
    bias_grad_drop(&bg, st);
    return st;
}

/* dx (M, K) = dpre (M, N) W (N, K), given to x */
static fsdp_status input_grad(fsdp_node *node, int ix, const fsdp_tensor *dpre, const fsdp_tensor *ws, lin_dims d) {
    if (!node_needs_grad(node, ix)) return FSDP_OK;
    fsdp_tensor *x = node->in[ix], *dx;
    FSDP_TRY(op_new_as(&dx, FSDP_BF16, x->ndim, x->shape));
    KERNELS(dx)->matmul_bf16(tensor_data(dx), tensor_data(dpre), tensor_data(ws), 1, d.M, d.K, d.N, 0, 0, 1.0f, 0.0f,
                             0, 0, 0);
    return op_give_grad(node, ix, dx);
}

/* ---- fsdp_linear ---- */

static fsdp_status linear_backward(fsdp_node *node) {
    fsdp_tensor *x = node->in[LIN_X], *w = node->in[LIN_W];
    int act = (int)node->i[0];
    bool has_res = node->i[1] != 0;
    lin_dims d = dims_of(x, w);
    fsdp_tensor *g, *dpre = NULL, *xs = NULL, *ws = NULL;
    FSDP_TRY(op_grad_out_as(node, 0, FSDP_BF16, &g));
    if (!g) return FSDP_OK;
    fsdp_status st = FSDP_OK;
    if (act == FSDP_LINEAR_GELU) {   /* d pre = dy gelu'(aux) */
        st = op_new_as(&dpre, FSDP_BF16, g->ndim, g->shape);
        if (st == FSDP_OK)
            KERNELS(g)->gelu_backward_bf16(tensor_data(dpre), tensor_data(node->saved[0]), tensor_data(g), d.M * d.N);
    } else {
        tensor_retain(g);
        dpre = g;
    }
    if (st == FSDP_OK) st = tensor_contiguous(&xs, x);
    if (st == FSDP_OK) st = tensor_contiguous(&ws, w);
    if (st == FSDP_OK) st = input_grad(node, LIN_X, dpre, ws, d);
    if (st == FSDP_OK) st = weight_grads(node, LIN_W, LIN_B, dpre, xs, d);
    if (st == FSDP_OK && has_res && node_needs_grad(node, LIN_RES)) {   /* the gradient itself, shared */
        tensor_retain(g);
        st = op_give_grad(node, LIN_RES, g);
    }
    tensor_release(xs);
    tensor_release(ws);
    tensor_release(dpre);
    tensor_release(g);
    return st;
}

/* The composition the fused op replaces (the CPU's path, and any device's
 * where the epilogue does not run). */
static fsdp_status linear_unfused(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *w, fsdp_tensor *bias,
                                  fsdp_tensor *res, int act) {
    fsdp_tensor *y, *t;
    FSDP_TRY(fsdp_matmul(&y, x, w, 0, 1));
    fsdp_status st = FSDP_OK;
    if (bias) {
        if (act == FSDP_LINEAR_GELU) st = fsdp_bias_gelu(&t, y, bias);
        else if (res) st = fsdp_bias_residual(&t, y, bias, res);
        else st = fsdp_add(&t, y, bias);
        tensor_release(y);
        if (st != FSDP_OK) return st;
        y = t;
        if (!(act == FSDP_LINEAR_GELU && res)) {
            *out = y;
            return FSDP_OK;
        }
    } else if (act == FSDP_LINEAR_GELU) {
        st = fsdp_gelu(&t, y);
        tensor_release(y);
        if (st != FSDP_OK) return st;
        y = t;
    }
    if (!res) {
        *out = y;
        return FSDP_OK;
    }
    st = fsdp_add(out, res, y);
    tensor_release(y);
    return st;
}

/* Whether the fused path may run: bf16 throughout, a bias, not both gelu
 * and res (the epilogue adds C before the activation), a non-empty product,
 * and the kernels its backward uses. */
static bool linear_fusable(fsdp_tensor *x, fsdp_tensor *bias, fsdp_tensor *res, int act, lin_dims d) {
    if (x->dtype != FSDP_BF16 || !bias || (res && act == FSDP_LINEAR_GELU)) return false;
    if (d.M <= 0 || d.N <= 0 || d.K <= 0) return false;
    const fsdp_device_kernels *k = KERNELS(x);
    return k->matmul_epilogue_bf16 && k->matmul_bf16 && k->sum_dim_bf16 && k->axpy_bf16 &&
           (act != FSDP_LINEAR_GELU || k->gelu_backward_bf16);
}

fsdp_status fsdp_linear(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight, fsdp_tensor *bias, fsdp_tensor *res,
                        int act) {
    TRACE_OP("linear", out);
    const char *names[] = {"x", "weight", "bias", "res"};
    fsdp_tensor *ts[] = {x, weight, bias, res};
    const bool optional[] = {false, false, true, true};
    const char *op = "fsdp_linear";
    FSDP_TRY(op_check(op, out, 4, names, ts, optional));
    FSDP_TRY(op_check_float(op, 4, names, ts));
    if (act != FSDP_LINEAR_NONE && act != FSDP_LINEAR_GELU)
        return op_fail(FSDP_ERR_INVALID, op, 4, names, ts, "act %d is not FSDP_LINEAR_NONE or FSDP_LINEAR_GELU", act);
    if (x->ndim < 2) return op_fail(FSDP_ERR_SHAPE, op, 4, names, ts, "x must have at least 2 dims (..., in)");
    if (weight->ndim != 2 || weight->shape[1] != x->shape[x->ndim - 1])
        return op_fail(FSDP_ERR_SHAPE, op, 4, names, ts, "weight must be (out, in) with in = %lld (the last dim of x)",
                       (long long)x->shape[x->ndim - 1]);
    int64_t n_out = weight->shape[0];
    if (bias && (bias->ndim != 1 || bias->shape[0] != n_out))
        return op_fail(FSDP_ERR_SHAPE, op, 4, names, ts, "bias must be 1-D with %lld elements (the rows of weight)",
                       (long long)n_out);
    if (res) {
        bool same = res->ndim == x->ndim && res->shape[x->ndim - 1] == n_out;
        for (int k = 0; same && k < x->ndim - 1; k++) same = res->shape[k] == x->shape[k];
        if (!same)
            return op_fail(FSDP_ERR_SHAPE, op, 4, names, ts,
                           "res must have the output's shape (x's with the last dim %lld); it is not broadcast",
                           (long long)n_out);
    }
    lin_dims d = dims_of(x, weight);
    if (!linear_fusable(x, bias, res, act, d)) return linear_unfused(out, x, weight, bias, res, act);

    fsdp_tensor *xs = NULL, *ws = NULL, *bs = NULL, *rs = NULL, *y = NULL, *aux = NULL;
    int64_t shape[FSDP_MAX_DIMS];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    shape[x->ndim - 1] = n_out;
    fsdp_status st = tensor_contiguous(&xs, x);
    if (st == FSDP_OK) st = tensor_contiguous(&ws, weight);
    if (st == FSDP_OK) st = tensor_contiguous(&bs, bias);
    if (st == FSDP_OK && res) st = tensor_contiguous(&rs, res);
    if (st == FSDP_OK) st = op_new_as(&y, FSDP_BF16, x->ndim, shape);
    bool record = tape_wants(res ? 4 : 3, ts);   /* the GELU input is kept only for a backward */
    if (st == FSDP_OK && act == FSDP_LINEAR_GELU && record) st = op_new_as(&aux, FSDP_BF16, x->ndim, shape);
    int ran = 0;
    if (st == FSDP_OK) {
        int epi = act != FSDP_LINEAR_GELU ? FSDP_EPILOGUE_BIAS
                  : record                ? FSDP_EPILOGUE_GELU_AUX_BIAS
                                          : FSDP_EPILOGUE_GELU_BIAS;
        ran = KERNELS(y)->matmul_epilogue_bf16(tensor_data(y), tensor_data(xs), tensor_data(ws),
                                               rs ? tensor_data(rs) : NULL, d.M, d.N, d.K, 0, 1, 1.0f,
                                               rs ? 1.0f : 0.0f, epi, tensor_data(bs), aux ? tensor_data(aux) : NULL,
                                               NULL);
    }
    tensor_release(xs);
    tensor_release(ws);
    tensor_release(bs);
    tensor_release(rs);
    if (st != FSDP_OK || !ran) {
        tensor_release(y);
        tensor_release(aux);
        return st != FSDP_OK ? st : linear_unfused(out, x, weight, bias, res, act);
    }
    fsdp_node *node = NULL;
    fsdp_tensor *saved[] = {aux};
    st = op_done(out, &node, y, FSDP_BF16, "linear", linear_backward, res ? 4 : 3, ts, aux ? 1 : 0, saved);
    if (st == FSDP_OK && node) {
        node->i[0] = act;
        node->i[1] = res != NULL;
    }
    return st;
}

/* ---- fsdp_mlp ---- */

/* node->in of the fused node (MLP_RES when node->i[0]); node->saved: aux
 * (M, H), the pre-activation, and h = gelu(aux) (M, H) */
enum { MLP_X, MLP_W_FC, MLP_B_FC, MLP_W_PROJ, MLP_B_PROJ, MLP_RES };

/* d pre (M, H) = (dy (M, N) W_proj (N, H)) gelu'(aux), with c_fc's bias
 * gradient, the column sums of d pre, from the same GEMM (DGELU_BGRAD);
 * unfused where the device does not take it: the GEMM, the GELU backward
 * and a column sum. */
static fsdp_status mlp_dpre(fsdp_node *node, const fsdp_tensor *g, const fsdp_tensor *w_proj, fsdp_tensor **dpre,
                            int64_t M, int64_t H, int64_t N) {
    const fsdp_device_kernels *k = KERNELS(g);
    const fsdp_tensor *aux = node->saved[0];
    int64_t shape[2] = {M, H};
    bool want_b = node_needs_grad(node, MLP_B_FC);
    bias_grad bg = {0};
    fsdp_tensor *scratch = NULL, *dh = NULL;   /* the epilogue's column sums when c_fc's bias wants none */
    FSDP_TRY(op_new_as(dpre, FSDP_BF16, 2, shape));
    fsdp_status st = want_b ? bias_grad_open(node, MLP_B_FC, H, &bg) : op_new_as(&scratch, FSDP_BF16, 1, &H);
    if (st == FSDP_OK) {
        uint16_t *dst = want_b ? bias_grad_dst(&bg) : tensor_data(scratch);
        bool fused = k->matmul_epilogue_bf16(tensor_data(*dpre), tensor_data(g), tensor_data(w_proj), NULL, M, H, N, 0,
                                             0, 1.0f, 0.0f, FSDP_EPILOGUE_DGELU_BGRAD, NULL, tensor_data(aux),
                                             dst) != 0;
        bool summed_into_grad = false;
        if (!fused) {
            st = op_new_as(&dh, FSDP_BF16, 2, shape);
            if (st == FSDP_OK) {
                k->matmul_bf16(tensor_data(dh), tensor_data(g), tensor_data(w_proj), 1, M, H, N, 0, 0, 1.0f, 0.0f, 0,
                               0, 0);
                k->gelu_backward_bf16(tensor_data(*dpre), tensor_data(aux), tensor_data(dh), M * H);
                if (want_b) {
                    bias_grad_sum(&bg, *dpre, M, H);
                    summed_into_grad = bg.grad && !bg.write && k->sum_dim_acc_bf16;
                }
            }
        }
        if (st == FSDP_OK && want_b) st = bias_grad_close(node, MLP_B_FC, &bg, summed_into_grad);
    }
    bias_grad_drop(&bg, st);
    tensor_release(scratch);
    tensor_release(dh);
    if (st != FSDP_OK) {
        tensor_release(*dpre);
        *dpre = NULL;
    }
    return st;
}

static fsdp_status mlp_backward(fsdp_node *node) {
    fsdp_tensor *x = node->in[MLP_X], *w_fc = node->in[MLP_W_FC], *w_proj = node->in[MLP_W_PROJ];
    bool has_res = node->i[0] != 0;
    lin_dims fc = dims_of(x, w_fc);                 /* M, H, C */
    lin_dims proj = {fc.M, w_proj->shape[0], fc.N}; /* M, N, H */
    fsdp_tensor *g, *dpre = NULL, *xs = NULL, *w_fc_s = NULL, *w_proj_s = NULL;
    FSDP_TRY(op_grad_out_as(node, 0, FSDP_BF16, &g));
    if (!g) return FSDP_OK;
    /* c_proj: dW_proj = dy^T h with its bias gradient (BGRAD_A) */
    fsdp_status st = weight_grads(node, MLP_W_PROJ, MLP_B_PROJ, g, node->saved[1], proj);
    bool want_fc = node_needs_grad(node, MLP_X) || node_needs_grad(node, MLP_W_FC) || node_needs_grad(node, MLP_B_FC);
    if (st == FSDP_OK && want_fc) st = tensor_contiguous(&w_proj_s, w_proj);
    if (st == FSDP_OK && want_fc) st = mlp_dpre(node, g, w_proj_s, &dpre, fc.M, fc.N, proj.N);
    /* c_fc: dW_fc = d pre^T x (its bias's gradient came with d pre), dx = d pre W_fc */
    if (st == FSDP_OK && want_fc) st = tensor_contiguous(&xs, x);
    if (st == FSDP_OK && want_fc) st = weight_grads(node, MLP_W_FC, -1, dpre, xs, fc);
    if (st == FSDP_OK && node_needs_grad(node, MLP_X)) st = tensor_contiguous(&w_fc_s, w_fc);
    if (st == FSDP_OK && node_needs_grad(node, MLP_X)) st = input_grad(node, MLP_X, dpre, w_fc_s, fc);
    if (st == FSDP_OK && has_res && node_needs_grad(node, MLP_RES)) {   /* the gradient itself, shared */
        tensor_retain(g);
        st = op_give_grad(node, MLP_RES, g);
    }
    tensor_release(xs);
    tensor_release(w_fc_s);
    tensor_release(w_proj_s);
    tensor_release(dpre);
    tensor_release(g);
    return st;
}

fsdp_status fsdp_mlp(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *w_fc, fsdp_tensor *b_fc, fsdp_tensor *w_proj,
                     fsdp_tensor *b_proj, fsdp_tensor *res) {
    TRACE_OP("mlp", out);
    const char *names[] = {"x", "w_fc", "b_fc", "w_proj", "b_proj", "res"};
    fsdp_tensor *ts[] = {x, w_fc, b_fc, w_proj, b_proj, res};
    const bool optional[] = {false, false, true, false, true, true};
    const char *op = "fsdp_mlp";
    FSDP_TRY(op_check(op, out, 6, names, ts, optional));
    FSDP_TRY(op_check_float(op, 6, names, ts));
    if (x->ndim < 2) return op_fail(FSDP_ERR_SHAPE, op, 6, names, ts, "x must have at least 2 dims (..., in)");
    int64_t C = x->shape[x->ndim - 1];
    if (w_fc->ndim != 2 || w_fc->shape[1] != C)
        return op_fail(FSDP_ERR_SHAPE, op, 6, names, ts, "w_fc must be (hidden, in) with in = %lld (the last dim of x)",
                       (long long)C);
    int64_t H = w_fc->shape[0];
    if (b_fc && (b_fc->ndim != 1 || b_fc->shape[0] != H))
        return op_fail(FSDP_ERR_SHAPE, op, 6, names, ts, "b_fc must be 1-D with %lld elements (the rows of w_fc)",
                       (long long)H);
    if (w_proj->ndim != 2 || w_proj->shape[1] != H)
        return op_fail(FSDP_ERR_SHAPE, op, 6, names, ts, "w_proj must be (out, hidden) with hidden = %lld (the rows of w_fc)",
                       (long long)H);
    int64_t N = w_proj->shape[0];
    if (b_proj && (b_proj->ndim != 1 || b_proj->shape[0] != N))
        return op_fail(FSDP_ERR_SHAPE, op, 6, names, ts, "b_proj must be 1-D with %lld elements (the rows of w_proj)",
                       (long long)N);
    if (res) {
        bool same = res->ndim == x->ndim && res->shape[x->ndim - 1] == N;
        for (int k = 0; same && k < x->ndim - 1; k++) same = res->shape[k] == x->shape[k];
        if (!same)
            return op_fail(FSDP_ERR_SHAPE, op, 6, names, ts,
                           "res must have the output's shape (x's with the last dim %lld); it is not broadcast",
                           (long long)N);
    }
    lin_dims fc = dims_of(x, w_fc);
    /* fused: both GEMMs with their epilogues; unfused: the two Linears (each fused on its own where it can be) */
    bool fusable = linear_fusable(x, b_fc, NULL, FSDP_LINEAR_GELU, fc) && b_proj && N > 0;
    fsdp_tensor *xs = NULL, *w1 = NULL, *b1 = NULL, *w2 = NULL, *b2 = NULL, *rs = NULL, *aux = NULL, *h = NULL,
                *y = NULL;
    fsdp_status st = FSDP_OK;
    int ran = 0;
    if (fusable) {
        int64_t hshape[2] = {fc.M, H}, shape[FSDP_MAX_DIMS];
        memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
        shape[x->ndim - 1] = N;
        st = tensor_contiguous(&xs, x);
        if (st == FSDP_OK) st = tensor_contiguous(&w1, w_fc);
        if (st == FSDP_OK) st = tensor_contiguous(&b1, b_fc);
        if (st == FSDP_OK) st = tensor_contiguous(&w2, w_proj);
        if (st == FSDP_OK) st = tensor_contiguous(&b2, b_proj);
        if (st == FSDP_OK && res) st = tensor_contiguous(&rs, res);
        bool record = tape_wants(res ? 6 : 5, ts);   /* the GELU input is kept only for a backward */
        if (st == FSDP_OK && record) st = op_new_as(&aux, FSDP_BF16, 2, hshape);
        if (st == FSDP_OK) st = op_new_as(&h, FSDP_BF16, 2, hshape);
        if (st == FSDP_OK) st = op_new_as(&y, FSDP_BF16, x->ndim, shape);
        const fsdp_device_kernels *k = KERNELS(x);
        if (st == FSDP_OK)   /* h = gelu(aux), aux = x W_fc^T + b_fc */
            ran = k->matmul_epilogue_bf16(tensor_data(h), tensor_data(xs), tensor_data(w1), NULL, fc.M, H, C, 0, 1,
                                          1.0f, 0.0f, record ? FSDP_EPILOGUE_GELU_AUX_BIAS : FSDP_EPILOGUE_GELU_BIAS,
                                          tensor_data(b1), aux ? tensor_data(aux) : NULL, NULL);
        if (st == FSDP_OK && ran)   /* y = [res +] h W_proj^T + b_proj */
            ran = k->matmul_epilogue_bf16(tensor_data(y), tensor_data(h), tensor_data(w2), rs ? tensor_data(rs) : NULL,
                                          fc.M, N, H, 0, 1, 1.0f, rs ? 1.0f : 0.0f, FSDP_EPILOGUE_BIAS,
                                          tensor_data(b2), NULL, NULL);
    }
    tensor_release(xs);
    tensor_release(w1);
    tensor_release(b1);
    tensor_release(w2);
    tensor_release(b2);
    tensor_release(rs);
    if (st != FSDP_OK || !ran) {
        tensor_release(aux);
        tensor_release(h);
        tensor_release(y);
        if (st != FSDP_OK) return st;
        fsdp_tensor *hid;   /* the two Linears */
        FSDP_TRY(fsdp_linear(&hid, x, w_fc, b_fc, NULL, FSDP_LINEAR_GELU));
        st = fsdp_linear(out, hid, w_proj, b_proj, res, FSDP_LINEAR_NONE);
        tensor_release(hid);
        return st;
    }
    fsdp_node *node = NULL;
    fsdp_tensor *saved[] = {aux, h};
    st = op_done(out, &node, y, FSDP_BF16, "mlp", mlp_backward, res ? 6 : 5, ts, 2, saved);
    if (st == FSDP_OK && node) node->i[0] = res != NULL;
    return st;
}
