/* ref_nn.h: naive double-precision references for the NN kernels
 * (activation, softmax, norm, embedding, cross-entropy, attention).
 * Plain loops, written from the math and not from the kernels: the backward
 * references go through explicit Jacobians or full matrices where the
 * kernels use shortcuts. */
#ifndef FSDP_REF_NN_H
#define FSDP_REF_NN_H
#include <stdint.h>

void ref_gelu(double *out, const double *x, int64_t n);   /* tanh form */
void ref_gelu_backward(double *dx, const double *x, const double *dout, int64_t n);
void ref_relu(double *out, const double *x, int64_t n);
void ref_relu_backward(double *dx, const double *x, const double *dout, int64_t n);
void ref_silu(double *out, const double *x, int64_t n);
void ref_silu_backward(double *dx, const double *x, const double *dout, int64_t n);

/* over the last dim of (rows, cols); backward takes the forward input x */
void ref_softmax(double *out, const double *x, int64_t rows, int64_t cols);
void ref_softmax_backward(double *dx, const double *x, const double *dy, int64_t rows, int64_t cols);
void ref_log_softmax(double *out, const double *x, int64_t rows, int64_t cols);
void ref_log_softmax_backward(double *dx, const double *x, const double *dy, int64_t rows, int64_t cols);

/* weight, bias may be NULL; mean, rstd may be NULL (not written) */
void ref_layernorm(double *out, double *mean, double *rstd, const double *x, const double *weight,
                   const double *bias, int64_t rows, int64_t cols, double eps);
/* dweight, dbias may be NULL */
void ref_layernorm_backward(double *dx, double *dweight, double *dbias, const double *dout, const double *x,
                            const double *weight, int64_t rows, int64_t cols, double eps);
void ref_rmsnorm(double *out, double *rstd, const double *x, const double *weight, int64_t rows, int64_t cols,
                 double eps);
void ref_rmsnorm_backward(double *dx, double *dweight, const double *dout, const double *x, const double *weight,
                          int64_t rows, int64_t cols, double eps);

void ref_embedding(double *out, const int64_t *ids, int64_t n, const double *table, int64_t dim);
void ref_embedding_backward(double *dtable, int64_t vocab, const int64_t *ids, int64_t n, const double *dout,
                            int64_t dim);

/* logits (N, V), first valid_v columns count; returns the non-ignored count */
int64_t ref_cross_entropy(double *losses, double *lse, const double *logits, const int64_t *targets, int64_t N,
                          int64_t V, int64_t valid_v, int64_t ignore_index);
void ref_cross_entropy_backward(double *dlogits, const double *logits, const int64_t *targets, int64_t N,
                                int64_t V, int64_t valid_v, int64_t ignore_index, double dloss);

/* (B, H, T, D); lse (B, H, T) may be NULL. Materializes (T, T) scores. */
void ref_attention(double *out, double *lse, const double *q, const double *k, const double *v, int64_t B,
                   int64_t H, int64_t T, int64_t D, int causal, double scale);
void ref_attention_backward(double *dq, double *dk, double *dv, const double *dout, const double *q,
                            const double *k, const double *v, int64_t B, int64_t H, int64_t T, int64_t D,
                            int causal, double scale);
#endif
