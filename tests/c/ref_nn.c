/* ref_nn.c: double-precision references for the NN kernels; see ref_nn.h. */
#include "ref_nn.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- activations ---- */

static const double K_GELU = 0.7978845608028654;   /* sqrt(2/pi) */

void ref_gelu(double *out, const double *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = 0.5 * x[i] * (1.0 + tanh(K_GELU * (x[i] + 0.044715 * x[i] * x[i] * x[i])));
}

void ref_gelu_backward(double *dx, const double *x, const double *dout, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        double t = tanh(K_GELU * (x[i] + 0.044715 * x[i] * x[i] * x[i]));
        double dt = (1.0 - t * t) * K_GELU * (1.0 + 3.0 * 0.044715 * x[i] * x[i]);
        dx[i] = dout[i] * (0.5 * (1.0 + t) + 0.5 * x[i] * dt);
    }
}

void ref_relu(double *out, const double *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = x[i] > 0 ? x[i] : 0.0;
}

void ref_relu_backward(double *dx, const double *x, const double *dout, int64_t n) {
    for (int64_t i = 0; i < n; i++) dx[i] = x[i] > 0 ? dout[i] : 0.0;
}

void ref_silu(double *out, const double *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = x[i] / (1.0 + exp(-x[i]));
}

void ref_silu_backward(double *dx, const double *x, const double *dout, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        double s = 1.0 / (1.0 + exp(-x[i]));
        dx[i] = dout[i] * (s + x[i] * s * (1.0 - s));
    }
}

/* ---- softmax ---- */

void ref_softmax(double *out, const double *x, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * cols;
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < cols; j++) mx = fmax(mx, xr[j]);
        for (int64_t j = 0; j < cols; j++) sum += exp(xr[j] - mx);
        for (int64_t j = 0; j < cols; j++) out[r * cols + j] = exp(xr[j] - mx) / sum;
    }
}

/* dx_k = sum_j dy_j dy_j/dx_k with the Jacobian d y_j / d x_k = y_j (delta_jk - y_k) */
void ref_softmax_backward(double *dx, const double *x, const double *dy, int64_t rows, int64_t cols) {
    double *y = malloc((size_t)(rows * cols) * sizeof(double));
    ref_softmax(y, x, rows, cols);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t kk = 0; kk < cols; kk++) {
            double acc = 0;
            for (int64_t j = 0; j < cols; j++)
                acc += dy[r * cols + j] * y[r * cols + j] * ((j == kk) - y[r * cols + kk]);
            dx[r * cols + kk] = acc;
        }
    free(y);
}

void ref_log_softmax(double *out, const double *x, int64_t rows, int64_t cols) {
    ref_softmax(out, x, rows, cols);
    for (int64_t i = 0; i < rows * cols; i++) out[i] = log(out[i]);
}

/* d log y_j / d x_k = delta_jk - y_k */
void ref_log_softmax_backward(double *dx, const double *x, const double *dy, int64_t rows, int64_t cols) {
    double *y = malloc((size_t)(rows * cols) * sizeof(double));
    ref_softmax(y, x, rows, cols);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t kk = 0; kk < cols; kk++) {
            double acc = 0;
            for (int64_t j = 0; j < cols; j++) acc += dy[r * cols + j] * ((j == kk) - y[r * cols + kk]);
            dx[r * cols + kk] = acc;
        }
    free(y);
}

/* ---- normalization ---- */

static void row_stats(const double *x, int64_t cols, double eps, double *mean, double *rstd) {
    double m = 0, v = 0;
    for (int64_t j = 0; j < cols; j++) m += x[j];
    m /= cols;
    for (int64_t j = 0; j < cols; j++) v += (x[j] - m) * (x[j] - m);
    *mean = m;
    *rstd = 1.0 / sqrt(v / cols + eps);
}

void ref_layernorm(double *out, double *mean, double *rstd, const double *x, const double *weight,
                   const double *bias, int64_t rows, int64_t cols, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        double m, s;
        row_stats(x + r * cols, cols, eps, &m, &s);
        for (int64_t j = 0; j < cols; j++)
            out[r * cols + j] = (x[r * cols + j] - m) * s * (weight ? weight[j] : 1.0) + (bias ? bias[j] : 0.0);
        if (mean) mean[r] = m;
        if (rstd) rstd[r] = s;
    }
}

/* d out_j / d x_k = w_j rstd (delta_jk - 1/C - xhat_j xhat_k / C) */
void ref_layernorm_backward(double *dx, double *dweight, double *dbias, const double *dout, const double *x,
                            const double *weight, int64_t rows, int64_t cols, double eps) {
    if (dweight) memset(dweight, 0, (size_t)cols * sizeof(double));
    if (dbias) memset(dbias, 0, (size_t)cols * sizeof(double));
    double *xhat = malloc((size_t)cols * sizeof(double));
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * cols, *g = dout + r * cols;
        double m, s;
        row_stats(xr, cols, eps, &m, &s);
        for (int64_t j = 0; j < cols; j++) xhat[j] = (xr[j] - m) * s;
        for (int64_t kk = 0; kk < cols; kk++) {
            double acc = 0;
            for (int64_t j = 0; j < cols; j++)
                acc += g[j] * (weight ? weight[j] : 1.0) * s *
                       ((j == kk) - 1.0 / cols - xhat[j] * xhat[kk] / cols);
            dx[r * cols + kk] = acc;
        }
        for (int64_t j = 0; j < cols; j++) {
            if (dweight) dweight[j] += g[j] * xhat[j];
            if (dbias) dbias[j] += g[j];
        }
    }
    free(xhat);
}

void ref_rmsnorm(double *out, double *rstd, const double *x, const double *weight, int64_t rows, int64_t cols,
                 double eps) {
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0;
        for (int64_t j = 0; j < cols; j++) ss += x[r * cols + j] * x[r * cols + j];
        double s = 1.0 / sqrt(ss / cols + eps);
        for (int64_t j = 0; j < cols; j++) out[r * cols + j] = x[r * cols + j] * s * (weight ? weight[j] : 1.0);
        if (rstd) rstd[r] = s;
    }
}

/* d out_j / d x_k = w_j rstd (delta_jk - xhat_j xhat_k / C) */
void ref_rmsnorm_backward(double *dx, double *dweight, const double *dout, const double *x, const double *weight,
                          int64_t rows, int64_t cols, double eps) {
    if (dweight) memset(dweight, 0, (size_t)cols * sizeof(double));
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * cols, *g = dout + r * cols;
        double ss = 0;
        for (int64_t j = 0; j < cols; j++) ss += xr[j] * xr[j];
        double s = 1.0 / sqrt(ss / cols + eps);
        for (int64_t kk = 0; kk < cols; kk++) {
            double acc = 0;
            for (int64_t j = 0; j < cols; j++)
                acc += g[j] * (weight ? weight[j] : 1.0) * s * ((j == kk) - xr[j] * s * xr[kk] * s / cols);
            dx[r * cols + kk] = acc;
        }
        if (dweight)
            for (int64_t j = 0; j < cols; j++) dweight[j] += g[j] * xr[j] * s;
    }
}

/* ---- embedding ---- */

void ref_embedding(double *out, const int64_t *ids, int64_t n, const double *table, int64_t dim) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < dim; j++) out[i * dim + j] = table[ids[i] * dim + j];
}

void ref_embedding_backward(double *dtable, int64_t vocab, const int64_t *ids, int64_t n, const double *dout,
                            int64_t dim) {
    memset(dtable, 0, (size_t)(vocab * dim) * sizeof(double));
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < dim; j++) dtable[ids[i] * dim + j] += dout[i * dim + j];
}

/* ---- cross-entropy ---- */

int64_t ref_cross_entropy(double *losses, double *lse, const double *logits, const int64_t *targets, int64_t N,
                          int64_t V, int64_t valid_v, int64_t ignore_index) {
    int64_t count = 0;
    for (int64_t n = 0; n < N; n++) {
        const double *x = logits + n * V;
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < valid_v; j++) mx = fmax(mx, x[j]);
        for (int64_t j = 0; j < valid_v; j++) sum += exp(x[j] - mx);
        double l = mx + log(sum);
        if (lse) lse[n] = l;
        if (targets[n] == ignore_index) {
            losses[n] = 0;
        } else {
            losses[n] = l - x[targets[n]];
            count++;
        }
    }
    return count;
}

void ref_cross_entropy_backward(double *dlogits, const double *logits, const int64_t *targets, int64_t N,
                                int64_t V, int64_t valid_v, int64_t ignore_index, double dloss) {
    memset(dlogits, 0, (size_t)(N * V) * sizeof(double));
    for (int64_t n = 0; n < N; n++) {
        if (targets[n] == ignore_index) continue;
        ref_softmax(dlogits + n * V, logits + n * V, 1, valid_v);
        for (int64_t j = 0; j < valid_v; j++) dlogits[n * V + j] = dloss * (dlogits[n * V + j] - (j == targets[n]));
    }
}

/* ---- attention ---- */

/* P (T, T) = softmax(scale Q K^T) with masked entries 0; lse (T) may be NULL */
static void ref_attn_probs(double *P, double *lse, const double *q, const double *k, int64_t T, int64_t D,
                           int causal, double scale) {
    for (int64_t i = 0; i < T; i++) {
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < T; j++) {
            double s = 0;
            for (int64_t d = 0; d < D; d++) s += q[i * D + d] * k[j * D + d];
            P[i * T + j] = causal && j > i ? -INFINITY : scale * s;
            mx = fmax(mx, P[i * T + j]);
        }
        for (int64_t j = 0; j < T; j++) sum += exp(P[i * T + j] - mx);
        for (int64_t j = 0; j < T; j++) P[i * T + j] = exp(P[i * T + j] - mx) / sum;
        if (lse) lse[i] = mx + log(sum);
    }
}

void ref_attention(double *out, double *lse, const double *q, const double *k, const double *v, int64_t B,
                   int64_t H, int64_t T, int64_t D, int causal, double scale) {
    double *P = malloc((size_t)(T * T) * sizeof(double));
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t off = bh * T * D;
        ref_attn_probs(P, lse ? lse + bh * T : NULL, q + off, k + off, T, D, causal, scale);
        for (int64_t i = 0; i < T; i++)
            for (int64_t d = 0; d < D; d++) {
                double acc = 0;
                for (int64_t j = 0; j < T; j++) acc += P[i * T + j] * v[off + j * D + d];
                out[off + i * D + d] = acc;
            }
    }
    free(P);
}

/* Through full matrices: dV = P^T dO, dP = dO V^T, dS through the softmax
 * Jacobian (dS_ij = P_ij (dP_ij - sum_l P_il dP_il)), dQ = scale dS K,
 * dK = scale dS^T Q. */
void ref_attention_backward(double *dq, double *dk, double *dv, const double *dout, const double *q,
                            const double *k, const double *v, int64_t B, int64_t H, int64_t T, int64_t D,
                            int causal, double scale) {
    double *P = malloc((size_t)(T * T) * sizeof(double)), *dP = malloc((size_t)(T * T) * sizeof(double));
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t off = bh * T * D;
        const double *qh = q + off, *kh = k + off, *vh = v + off, *go = dout + off;
        ref_attn_probs(P, NULL, qh, kh, T, D, causal, scale);
        for (int64_t j = 0; j < T; j++)
            for (int64_t d = 0; d < D; d++) {
                double acc = 0;
                for (int64_t i = 0; i < T; i++) acc += P[i * T + j] * go[i * D + d];
                dv[off + j * D + d] = acc;
            }
        for (int64_t i = 0; i < T; i++)
            for (int64_t j = 0; j < T; j++) {
                double acc = 0;
                for (int64_t d = 0; d < D; d++) acc += go[i * D + d] * vh[j * D + d];
                dP[i * T + j] = acc;
            }
        for (int64_t i = 0; i < T; i++) {
            double dot = 0;
            for (int64_t j = 0; j < T; j++) dot += P[i * T + j] * dP[i * T + j];
            for (int64_t j = 0; j < T; j++) dP[i * T + j] = P[i * T + j] * (dP[i * T + j] - dot);   /* now dS */
        }
        for (int64_t i = 0; i < T; i++)
            for (int64_t d = 0; d < D; d++) {
                double accq = 0, acck = 0;
                for (int64_t j = 0; j < T; j++) {
                    accq += dP[i * T + j] * kh[j * D + d];
                    acck += dP[j * T + i] * qh[j * D + d];
                }
                dq[off + i * D + d] = scale * accq;
                dk[off + i * D + d] = scale * acck;
            }
    }
    free(P);
    free(dP);
}
