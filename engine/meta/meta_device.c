/* meta_device.c: the counting device (DESIGN.md, decisions 11 and 13).
 *
 * A kernel table whose entries compute nothing: each call only adds to its
 * entry's counters (calls, bytes read and written, FLOPs, kernel launches,
 * host syncs) what the kernel would cost on a GPU. Its memory comes from the
 * engine's real caching allocator (alloc.c), so sizes, tags, caching and
 * peaks are exactly those of a real run, but raw_alloc hands out address
 * space that can never be read or written (PROT_NONE): no memory is
 * touched, and host code that reads a meta tensor by mistake faults at once
 * instead of reading garbage. Values that go back to the host (copies,
 * sums, counts) are zeros, so a recipe's control flow goes on as usual.
 *
 * The planner (`fsdp-lua --plan`) runs the real model, schedule and
 * optimizer on it; tools/gpu-model prices its counts. fsdp_meta_mimic picks
 * whose kernel set the table offers: an entry the mimicked device lacks
 * (NULL there) is NULL here too, so the op layer takes exactly the path it
 * takes on that device (bf16 matmul natively on CUDA, staged through f32 on
 * the CPU, ...).
 *
 * Adding a table entry (engine/core/kernels.def): add its cost line,
 * COST_<name>, below: AUTO and its cost (bytes read, bytes written, FLOPs,
 * launches, host syncs, result), or, when what it costs depends on whether
 * it runs, HAND and its counting function meta_<name>. Without one the
 * build fails. */
#define _DEFAULT_SOURCE   /* MAP_ANONYMOUS, MAP_NORESERVE under -std=c11 */
#include "internal.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "meta_cost_shapes.h"   /* the cost table's shape helpers */
#include "timeline.h"

/* ---- the cost table ----
 * #define COST_<name> AUTO, family, read, written, flops, launches, syncs, result
 * (the entry's parameters, from kernels.def, are in scope)
 * Bytes are device memory traffic (a copy from the host writes, one to the
 * host reads) in the dtypes the kernel sees: f32 = 4,
 * bf16 = 2, i64 ids = 8. FLOPs count multiply-adds as 2; elementwise
 * transcendentals as the few FLOPs they take (they are memory-bound
 * anyway). Attention counts the products it computes (a causal one half of
 * them). Launches count the GPU operations an entry puts on the stream
 * (kernels, memsets, copies: a value read back is its kernels and a copy,
 * as engine/cuda does it). A sync is a point where the host waits for the
 * device: a value or a copy coming back. result is what a non-void entry
 * returns, or for a void one what it does after counting (record_l2: the
 * part of its bytes read that an L2 rule serves from L2). */
#define F32 4
#define NPB(dw, db) norm_bwd_partial_bytes(rows, cols, dw, db)   /* (in the norm backward lines) */
#define BF16 2
#define COST_zero AUTO, "copy", 0, nbytes, 0, 1, 0,
#define COST_copy_from_host AUTO, "transfer", 0, nbytes, 0, 1, 0,
#define COST_copy_to_host AUTO, "transfer", nbytes, 0, 0, 1, 1, memset(host_dst, 0, nbytes)
#define COST_synchronize AUTO, "sync", 0, 0, 0, 0, 1,
#define COST_cast_any AUTO, "cast", n * dtype_bytes(in_dtype), n * dtype_bytes(out_dtype), 0, 1, 0,
#define COST_copy_strided AUTO, "copy", distinct_elems(ndim, shape, src_strides) * elem_size, \
    numel_of(ndim, shape) * elem_size, 0, 1, 0,
#define COST_fill_f32 AUTO, "copy", 0, F32 * n, 0, 1, 0,
#define COST_matmul_f32 AUTO, "gemm_f32", \
    F32 * (batch * M * K + (stride_b ? batch : 1) * K * N + (beta != 0) * batch * M * N), F32 * batch * M * N, \
    2 * batch * M * N * K, 1, 0,
#define COST_matmul_bf16 AUTO, "gemm_bf16", \
    BF16 * (batch * M * K + (stride_b ? batch : 1) * K * N + (beta != 0) * batch * M * N), BF16 * batch * M * N, \
    2 * batch * M * N * K, 1, 0,
#define COST_binary_f32 AUTO, "elementwise", \
    F32 * (distinct_elems(ndim, shape, a_strides) + distinct_elems(ndim, shape, b_strides)), \
    F32 * numel_of(ndim, shape), numel_of(ndim, shape), 1, 0,
#define COST_scale_f32 AUTO, "elementwise", F32 * n, F32 * n, n, 1, 0,
#define COST_add_scalar_f32 AUTO, "elementwise", F32 * n, F32 * n, n, 1, 0,
#define COST_axpy_f32 AUTO, "elementwise", 2 * F32 * n, F32 * n, 2 * n, 1, 0,
#define COST_sum_dim_f32 AUTO, "reduce", F32 * outer * red * inner, F32 * outer * inner, outer * red * inner, \
    sum_dim_launches(outer, red, inner, 0), 0,
#define COST_sum_all_f32 AUTO, "reduce", F32 * n, 0, n, 3, 1, 0
#define COST_sumsq_f32 AUTO, "reduce", F32 * n, 0, 2 * n, 3, 1, 0
#define COST_binary_bf16 AUTO, "elementwise", \
    BF16 * (distinct_elems(ndim, shape, a_strides) + distinct_elems(ndim, shape, b_strides)), \
    BF16 * numel_of(ndim, shape), numel_of(ndim, shape), 1, 0,
#define COST_scale_bf16 AUTO, "elementwise", BF16 * n, BF16 * n, n, 1, 0,
#define COST_add_scalar_bf16 AUTO, "elementwise", BF16 * n, BF16 * n, n, 1, 0,
#define COST_axpy_bf16 AUTO, "elementwise", 2 * BF16 * n, BF16 * n, 2 * n, 1, 0,
#define COST_sum_dim_bf16 AUTO, "reduce", BF16 * outer * red * inner, BF16 * outer * inner, outer * red * inner, \
    sum_dim_launches(outer, red, inner, 0), 0,
#define COST_sumsq_many_f32 AUTO, "reduce", F32 * sum_counts(counts, n), 0, 2 * sum_counts(counts, n), \
    (n + 13) / 14 + 2, 1, 0
#define COST_axpy_f32_bf16 AUTO, "elementwise", (F32 + BF16) * n, F32 * n, 2 * n, 1, 0,
#define COST_relu_forward_f32 AUTO, "activation", F32 * n, F32 * n, n, 1, 0,
#define COST_relu_backward_f32 AUTO, "activation", 2 * F32 * n, F32 * n, n, 1, 0,
#define COST_relu_forward_bf16 AUTO, "activation", BF16 * n, BF16 * n, n, 1, 0,
#define COST_relu_backward_bf16 AUTO, "activation", 2 * BF16 * n, BF16 * n, n, 1, 0,
#define COST_gelu_forward_f32 AUTO, "activation", F32 * n, F32 * n, 8 * n, 1, 0,
#define COST_gelu_backward_f32 AUTO, "activation", 2 * F32 * n, F32 * n, 12 * n, 1, 0,
#define COST_silu_forward_f32 AUTO, "activation", F32 * n, F32 * n, 4 * n, 1, 0,
#define COST_silu_backward_f32 AUTO, "activation", 2 * F32 * n, F32 * n, 8 * n, 1, 0,
#define COST_softmax_forward_f32 AUTO, "softmax", F32 * rows * cols, F32 * rows * cols, 5 * rows * cols, 1, 0,
#define COST_softmax_backward_f32 AUTO, "softmax", 2 * F32 * rows * cols, F32 * rows * cols, 4 * rows * cols, 1, 0,
#define COST_log_softmax_forward_f32 AUTO, "softmax", F32 * rows * cols, F32 * rows * cols, 5 * rows * cols, 1, 0,
#define COST_log_softmax_backward_f32 AUTO, "softmax", 2 * F32 * rows * cols, F32 * rows * cols, 4 * rows * cols, 1, \
    0,
#define COST_gelu_forward_bf16 AUTO, "activation", BF16 * n, BF16 * n, 8 * n, 1, 0,
#define COST_gelu_backward_bf16 AUTO, "activation", 2 * BF16 * n, BF16 * n, 12 * n, 1, 0,
#define COST_silu_forward_bf16 AUTO, "activation", BF16 * n, BF16 * n, 4 * n, 1, 0,
#define COST_silu_backward_bf16 AUTO, "activation", 2 * BF16 * n, BF16 * n, 8 * n, 1, 0,
#define COST_softmax_forward_bf16 AUTO, "softmax", BF16 * rows * cols, BF16 * rows * cols, 5 * rows * cols, 1, 0,
#define COST_softmax_backward_bf16 AUTO, "softmax", 2 * BF16 * rows * cols, BF16 * rows * cols, 4 * rows * cols, 1, \
    0,
#define COST_log_softmax_forward_bf16 AUTO, "softmax", BF16 * rows * cols, BF16 * rows * cols, 5 * rows * cols, 1, \
    0,
#define COST_log_softmax_backward_bf16 AUTO, "softmax", 2 * BF16 * rows * cols, BF16 * rows * cols, 4 * rows * cols, \
    1, 0,
#define COST_layernorm_forward_f32 AUTO, "norm", \
    F32 * (rows * cols + (weight != NULL) * cols + (bias != NULL) * cols), F32 * (rows * cols + 2 * rows), \
    8 * rows * cols, 1, 0,
#define COST_layernorm_backward_f32 AUTO, "norm", \
    F32 * (2 * rows * cols + (weight != NULL) * cols + 2 * rows) + \
        norm_bwd_reread(cols, dweight, dbias) * F32 * 2 * rows * cols + NPB(dweight, dbias), \
    F32 * (rows * cols + (dweight != NULL) * cols + (dbias != NULL) * cols) + NPB(dweight, dbias), 12 * rows * cols, \
    norm_bwd_launches(rows, cols, dweight, dbias, 0), 0,
#define COST_rmsnorm_forward_f32 AUTO, "norm", F32 * (rows * cols + (weight != NULL) * cols), \
    F32 * (rows * cols + rows), 5 * rows * cols, 1, 0,
#define COST_rmsnorm_backward_f32 AUTO, "norm", \
    F32 * (2 * rows * cols + (weight != NULL) * cols + rows) + \
        norm_bwd_reread(cols, dweight, NULL) * F32 * 2 * rows * cols + NPB(dweight, NULL), \
    F32 * (rows * cols + (dweight != NULL) * cols) + NPB(dweight, NULL), 8 * rows * cols, \
    norm_bwd_launches(rows, cols, dweight, NULL, 0), 0,
#define COST_layernorm_forward_bf16 AUTO, "norm", \
    BF16 * (rows * cols + (weight != NULL) * cols + (bias != NULL) * cols), BF16 * rows * cols + F32 * 2 * rows, \
    8 * rows * cols, 1, 0,
#define COST_layernorm_backward_bf16 AUTO, "norm", \
    BF16 * (2 * rows * cols + (weight != NULL) * cols) + F32 * 2 * rows + \
        norm_bwd_reread(cols, dweight, dbias) * BF16 * 2 * rows * cols + NPB(dweight, dbias), \
    BF16 * (rows * cols + (dweight != NULL) * cols + (dbias != NULL) * cols) + NPB(dweight, dbias), \
    12 * rows * cols, norm_bwd_launches(rows, cols, dweight, dbias, 0), 0,
#define COST_rmsnorm_forward_bf16 AUTO, "norm", BF16 * (rows * cols + (weight != NULL) * cols), \
    BF16 * rows * cols + F32 * rows, 5 * rows * cols, 1, 0,
#define COST_rmsnorm_backward_bf16 AUTO, "norm", \
    BF16 * (2 * rows * cols + (weight != NULL) * cols) + F32 * rows + \
        norm_bwd_reread(cols, dweight, NULL) * BF16 * 2 * rows * cols + NPB(dweight, NULL), \
    BF16 * (rows * cols + (dweight != NULL) * cols) + NPB(dweight, NULL), 8 * rows * cols, \
    norm_bwd_launches(rows, cols, dweight, NULL, 0), 0,
#define COST_embedding_forward_f32 AUTO, "embedding", 8 * n + F32 * n * dim, F32 * n * dim, 0, 1, 0,
/* embedding.cu: a memset of the table, then the scatter's read-modify-write of the ids' rows */
#define COST_embedding_backward_f32 AUTO, "embedding", 8 * n + 2 * F32 * n * dim, \
    (vocab > 0 && dim > 0) * F32 * (vocab * dim + n * dim), n * dim, (vocab > 0 && dim > 0) * (1 + (n > 0)), 0,
#define COST_cross_entropy_forward_f32 AUTO, "loss", F32 * N * V + 8 * N, 2 * F32 * N, 4 * N * valid_v, 3, 1, \
    ignore_index == 0 ? 0 : N
#define COST_cross_entropy_backward_f32 AUTO, "loss", F32 * N * V + F32 * N + 8 * N + F32, F32 * N * V, \
    3 * N * valid_v, 1, 0,
#define COST_cross_entropy_forward_bf16 AUTO, "loss", BF16 * N * V + 8 * N, 2 * F32 * N, 4 * N * valid_v, 3, 1, \
    ignore_index == 0 ? 0 : N
#define COST_cross_entropy_backward_bf16 AUTO, "loss", BF16 * N * V + F32 * N + 8 * N + F32, BF16 * N * V, \
    3 * N * valid_v, 1, 0,
#define COST_cross_entropy_rows_f32 AUTO, "loss", F32 * N * V + 8 * N, 2 * F32 * N, 4 * N * valid_v, 1, 0,
#define COST_cross_entropy_rows_bf16 AUTO, "loss", BF16 * N * V + 8 * N, 2 * F32 * N, 4 * N * valid_v, 1, 0,
/* the fused classifier: the logits read once (a block's second visit of its row is served from L2: 1024 threads
 * a row, 2 blocks an SM, 264 rows of 100 KB at GPT-2's vocabulary in flight on an H200, 26 MB of its 50 MB L2),
 * dlogits written over them */
#define COST_cross_entropy_fused_f32 AUTO, "loss", F32 * N * V + 8 * N, F32 * N * V + F32 * N, 7 * N * valid_v, 1, \
    0,
#define COST_cross_entropy_fused_bf16 AUTO, "loss", BF16 * N * V + 8 * N, BF16 * N * V + F32 * N, 7 * N * valid_v, \
    1, 0,
#define COST_embedding_backward_bf16 AUTO, "embedding", EMB_SORTED_READ(n, dim, BF16), \
    BF16 * vocab * dim + EMB_SORTED_WRITTEN(n, dim, BF16), n * dim, \
    (vocab > 0 && dim > 0) + EMB_SORTED_LAUNCHES(n, dim), 0,
#define COST_embedding_forward_bf16 AUTO, "embedding", 8 * n + BF16 * n * dim, BF16 * n * dim, 0, 1, 0,
#define COST_attention_forward_f32 AUTO, "attention", 3 * F32 * B * H * T * D, F32 * (B * H * T * D + B * H * T), \
    (causal ? 2 : 4) * B * H * T * T * D, 1, 0,
#define COST_attention_backward_f32 AUTO, "attention", F32 * (5 * B * H * T * D + B * H * T), \
    3 * F32 * B * H * T * D, (causal ? 5 : 10) * B * H * T * T * D, 1, 0,
/* packed bf16 attention on the tensor cores (attention_gemm.cu): a pointer-array kernel, the batched GEMMs
 * over all T x T scores (the causal mask is applied after them; FLOPs count the useful half, as above), the row
 * kernels */
#define COST_attention_qkv_forward_bf16 AUTO, "attention_bf16", \
    BF16 * 3 * B * H * T * D + (causal ? F32 / 2 : F32) * B * H * T * T + BF16 * B * H * T * T, \
    BF16 * B * H * T * D + (F32 + BF16) * B * H * T * T + 6 * 8 * B * H, (causal ? 2 : 4) * B * H * T * T * D, 4, 0,
#define COST_attention_qkv_backward_bf16 AUTO, "attention_bf16", \
    BF16 * 5 * B * H * T * D + (F32 + 4 * BF16) * B * H * T * T, \
    BF16 * 3 * B * H * T * D + (F32 + BF16) * B * H * T * T + 10 * 8 * B * H, (causal ? 4 : 8) * B * H * T * T * D, \
    6, 0,
/* fused flash attention (attention_flash.cu): q once and k, v once per query tile walked (the recompute
 * reads); the backward: the Drow and dQ kernel (q, dO, O, lse once, k, v per query tile walked; writes Drow),
 * then the dK, dV kernel (k, v once, q, dO, lse, Drow per key tile walked). Bytes read count every read;
 * record_l2 the re-reads flash_l2_holds serves from L2. FLOPs: the model's, as the GEMM path counts them; the
 * backward computes the scores and dP twice (once per kernel), which tools/gpu_model.lua prices */
#define COST_attention_flash_forward_bf16 AUTO, "attention_bf16", \
    BF16 * B * H * D * (T + 2 * flash_walked_rows(T, causal)), BF16 * B * H * T * D + F32 * B * H * T, \
    (causal ? 2 : 4) * B * H * T * T * D, 1, 0, \
    record_l2(E_attention_flash_forward_bf16, flash_fwd_l2(B, H, T, D, causal))
#define COST_attention_flash_backward_bf16 AUTO, "attention_bf16", \
    B * H * (BF16 * 3 * T * D + F32 * T + flash_walked_rows(T, causal) * BF16 * 2 * D + BF16 * 2 * T * D + \
        flash_walked_rows(T, causal) * (BF16 * 2 * D + 2 * F32)), \
    B * H * (F32 * T + BF16 * 3 * T * D), (causal ? 4 : 8) * B * H * T * T * D, 2, 0, \
    record_l2(E_attention_flash_backward_bf16, flash_bwd_l2(B, H, T, D, causal))
#define COST_classifier_lse_f32 AUTO, "loss", F32 * N * blocks * block_rows + 8 * N + 3 * F32 * N, 3 * F32 * N, \
    4 * N * blocks * block_rows, 1, 0,
#define COST_classifier_finish_f32 AUTO, "loss", 3 * F32 * N + 8 * N, 2 * F32 * N, 4 * N, 3, 1, \
    ignore_index == 0 ? 0 : N
#define COST_classifier_dlogits_f32 AUTO, "loss", F32 * N * blocks * block_rows + F32 * N + 8 * N + F32, \
    F32 * N * blocks * block_rows, 3 * N * blocks * block_rows, 1, 0,
#define COST_embedding_slice_forward_f32 AUTO, "embedding", 8 * n + F32 * n * dim, F32 * n * dim, 0, 1, 0,
#define COST_embedding_slice_backward_f32 AUTO, "embedding", 8 * n + F32 * n * dim, F32 * blocks * block_rows * dim, \
    n * dim, 2, 0,
#define COST_init_normal_f32 AUTO, "init", 0, F32 * n, 0, 1, 0,
#define COST_init_uniform_f32 AUTO, "init", 0, F32 * n, 0, 1, 0,
#define COST_dropout_f32 AUTO, "elementwise", F32 * n, F32 * n, 2 * n, 1, 0,
#define COST_adamw_f32 AUTO, "optimizer", 4 * F32 * n, 3 * F32 * n, 13 * n, 1, 0,
#define COST_sgd_f32 AUTO, "optimizer", F32 * n * (buf ? 3 : 2), F32 * n * (buf ? 2 : 1), 4 * n, 1, 0,
#define COST_adamw_many_f32 AUTO, "optimizer", 4 * F32 * sum_counts(counts, n), \
    3 * F32 * sum_counts(counts, n) + BF16 * sum_counts_with(counts, (void *const *)pb, n), \
    13 * sum_counts(counts, n), (nonempty(counts, n) + 55) / 56, 0,
#define COST_sum_dim_acc_bf16 AUTO, "reduce", BF16 * (outer * red * inner + outer * inner), BF16 * outer * inner, \
    outer * red * inner, sum_dim_launches(outer, red, inner, 1), 0,
#define COST_layernorm_backward_acc_bf16 AUTO, "norm", \
    BF16 * (2 * rows * cols + (weight != NULL) * cols) + F32 * 2 * rows + \
        norm_bwd_reread(cols, dweight, dbias) * BF16 * 2 * rows * cols + NPB(dweight, dbias) + \
        BF16 * ((dweight != NULL) + (dbias != NULL)) * cols, \
    BF16 * (rows * cols + (dweight != NULL) * cols + (dbias != NULL) * cols) + NPB(dweight, dbias), \
    12 * rows * cols, norm_bwd_launches(rows, cols, dweight, dbias, 1), 0,
#define COST_layernorm_backward_addx_bf16 AUTO, "norm", \
    BF16 * (3 * rows * cols + (weight != NULL) * cols) + F32 * 2 * rows + \
        norm_bwd_reread(cols, dweight, dbias) * BF16 * 2 * rows * cols + NPB(dweight, dbias) + \
        acc * BF16 * ((dweight != NULL) + (dbias != NULL)) * cols, \
    BF16 * (rows * cols + (dweight != NULL) * cols + (dbias != NULL) * cols) + NPB(dweight, dbias), \
    13 * rows * cols, norm_bwd_launches(rows, cols, dweight, dbias, acc), 0,
#define COST_embedding_backward_acc_bf16 AUTO, "embedding", EMB_SORTED_READ(n, dim, BF16), \
    EMB_SORTED_WRITTEN(n, dim, BF16), n * dim, EMB_SORTED_LAUNCHES(n, dim), 0,
#define COST_embedding_backward_acc_f32 AUTO, "embedding", EMB_SORTED_READ(n, dim, F32), \
    EMB_SORTED_WRITTEN(n, dim, F32), n * dim, EMB_SORTED_LAUNCHES(n, dim), 0,
#define COST_bias_gelu_forward_f32 AUTO, "activation", F32 * (rows * cols + cols), F32 * rows * cols, \
    9 * rows * cols, rows > 0 && cols > 0, 0,
#define COST_bias_gelu_forward_bf16 AUTO, "activation", BF16 * (rows * cols + cols), BF16 * rows * cols, \
    9 * rows * cols, rows > 0 && cols > 0, 0,
#define COST_bias_gelu_backward_f32 AUTO, "activation", \
    F32 * (2 * rows * cols + cols + (dbias && acc) * cols) + gelu_bwd_partial_bytes(rows, cols, F32, dbias), \
    F32 * (rows * cols + (dbias != NULL) * cols) + gelu_bwd_partial_bytes(rows, cols, F32, dbias), 14 * rows * cols, \
    gelu_bwd_launches(rows, cols, F32, dbias, acc), 0,
#define COST_bias_gelu_backward_bf16 AUTO, "activation", \
    BF16 * (2 * rows * cols + cols + (dbias && acc) * cols) + gelu_bwd_partial_bytes(rows, cols, BF16, dbias), \
    BF16 * (rows * cols + (dbias != NULL) * cols) + gelu_bwd_partial_bytes(rows, cols, BF16, dbias), \
    14 * rows * cols, gelu_bwd_launches(rows, cols, BF16, dbias, acc), 0,
#define COST_bias_residual_f32 AUTO, "elementwise", F32 * (2 * rows * cols + cols), F32 * rows * cols, \
    2 * rows * cols, rows > 0 && cols > 0, 0,
#define COST_bias_residual_bf16 AUTO, "elementwise", BF16 * (2 * rows * cols + cols), BF16 * rows * cols, \
    2 * rows * cols, rows > 0 && cols > 0, 0,

/* Entries whose counts depend on whether the device would run them (and its
 * memory): their counting functions are written out below. */
#define COST_raw_alloc HAND, "memory"
#define COST_raw_free HAND, "memory"
#define COST_matmul_epilogue_bf16 HAND, "gemm_bf16"
#define COST_host_alloc HAND, "memory"
#define COST_host_free HAND, "memory"
#define COST_copy_from_host_async HAND, "transfer"
#define COST_copy_to_host_async HAND, "transfer"
#define COST_fence_wait HAND, "sync"

/* ---- counters ---- */

/* COST_<name>'s family */
#define META_FAMILY(c) META_FAMILY_(c)
#define META_FAMILY_(kind, family, ...) family

enum {   /* one counter set per entry, in the table's order */
#define FSDP_KERNEL(ret, name, params, has) E_##name,
#include "kernels.def"
    E_COUNT
};

static const char *const entry_names[E_COUNT] = {
#define FSDP_KERNEL(ret, name, params, has) #name,
#include "kernels.def"
};

static const char *const entry_families[E_COUNT] = {
#define FSDP_KERNEL(ret, name, params, has) META_FAMILY(COST_##name),
#include "kernels.def"
};

typedef struct {
    int64_t calls, bytes_read, bytes_written, flops, launches, syncs, bytes_l2;
} entry_counts;

static pthread_mutex_t counts_mu = PTHREAD_MUTEX_INITIALIZER;
static entry_counts counts[E_COUNT];

static void record(int e, int64_t rd, int64_t wr, int64_t flops, int64_t launches, int64_t syncs) {
    pthread_mutex_lock(&counts_mu);
    entry_counts *c = &counts[e];
    c->calls++;
    c->bytes_read += rd;
    c->bytes_written += wr;
    c->flops += flops;
    c->launches += launches;
    c->syncs += syncs;
    pthread_mutex_unlock(&counts_mu);
    timeline_kernel(e, rd, wr, flops, launches, syncs);
}

/* Of the bytes entry e's last call read, those a stated L2 rule serves from
 * L2 rather than DRAM (they stay counted in bytes_read too). */
static void record_l2(int e, int64_t bytes) {
    pthread_mutex_lock(&counts_mu);
    counts[e].bytes_l2 += bytes;
    pthread_mutex_unlock(&counts_mu);
}

/* ---- memory: address space nobody can touch ---- */

/* Each block is its own PROT_NONE mapping; a small open-addressing table
 * remembers its length for munmap. */
#define BLOCKS_MIN 1024
static pthread_mutex_t blocks_mu = PTHREAD_MUTEX_INITIALIZER;
static struct block { void *ptr; size_t len; } *blocks;
static size_t blocks_cap, blocks_used;

static size_t block_slot(void *p, size_t cap) { return ((uintptr_t)p >> 12) * 0x9e3779b97f4a7c15ull % cap; }

static bool blocks_put(void *p, size_t len) {
    if ((blocks_used + 1) * 2 > blocks_cap) {
        size_t cap = blocks_cap ? blocks_cap * 2 : BLOCKS_MIN;
        struct block *nb = calloc(cap, sizeof *nb);
        if (!nb) return false;
        for (size_t i = 0; i < blocks_cap; i++) {
            if (!blocks[i].ptr) continue;
            size_t s = block_slot(blocks[i].ptr, cap);
            while (nb[s].ptr) s = (s + 1) % cap;
            nb[s] = blocks[i];
        }
        free(blocks);
        blocks = nb;
        blocks_cap = cap;
    }
    size_t s = block_slot(p, blocks_cap);
    while (blocks[s].ptr) s = (s + 1) % blocks_cap;
    blocks[s].ptr = p;
    blocks[s].len = len;
    blocks_used++;
    return true;
}

/* Removes p; returns its length (0 when unknown). */
static size_t blocks_take(void *p) {
    if (!blocks_cap) return 0;
    size_t s = block_slot(p, blocks_cap);
    while (blocks[s].ptr && blocks[s].ptr != p) s = (s + 1) % blocks_cap;
    if (!blocks[s].ptr) return 0;
    size_t len = blocks[s].len;
    blocks[s].ptr = NULL;
    blocks_used--;
    /* re-insert the rest of the probe chain */
    for (size_t t = (s + 1) % blocks_cap; blocks[t].ptr; t = (t + 1) % blocks_cap) {
        struct block b = blocks[t];
        blocks[t].ptr = NULL;
        size_t u = block_slot(b.ptr, blocks_cap);
        while (blocks[u].ptr) u = (u + 1) % blocks_cap;
        blocks[u] = b;
    }
    return len;
}

static void *meta_raw_alloc(size_t nbytes) {
    record(E_raw_alloc, 0, 0, 0, 0, 0);
    size_t len = nbytes ? nbytes : 1;
    void *p = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return NULL;   /* the allocator reports it as out of memory */
    pthread_mutex_lock(&blocks_mu);
    bool ok = blocks_put(p, len);
    pthread_mutex_unlock(&blocks_mu);
    if (!ok) {
        munmap(p, len);
        return NULL;
    }
    return p;
}

/* cudaFree waits for the device: a sync where the meta device mimics one. */
static void meta_raw_free(void *ptr) {
    record(E_raw_free, 0, 0, 0, 0, 1);
    if (!ptr) return;
    pthread_mutex_lock(&blocks_mu);
    size_t len = blocks_take(ptr);
    pthread_mutex_unlock(&blocks_mu);
    if (len) munmap(ptr, len);
}

/* ---- the counting entries ---- */

#define META_RETURN_void(v) v; return
#define META_RETURN_double(v) return (double)(v)
#define META_RETURN_int64_t(v) return (int64_t)(v)
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#endif
/* an AUTO entry's counting function from its cost line; a HAND one's is written out below */
#define META_FN(ret, name, params, c) META_FN_(ret, name, params, c)
#define META_FN_(ret, name, params, kind, ...) META_FN_##kind(ret, name, params, __VA_ARGS__)
#define META_FN_HAND(...)
#define META_FN_AUTO(ret, name, params, family, rd, wr, fl, launches, syncs, result)                               \
    static ret meta_##name params {                                                                               \
        record(E_##name, (int64_t)(rd), (int64_t)(wr), (int64_t)(fl), launches, syncs);                             \
        META_RETURN_##ret(result);                                                                                \
    }
#define FSDP_KERNEL(ret, name, params, has) META_FN(ret, name, params, COST_##name)
#include "kernels.def"
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

/* matmul_epilogue_bf16 counts only what the CUDA entry would run
 * (matmul_epilogue_covers): a call it refuses costs nothing here, and the
 * unfused ops the op layer then runs count themselves. Bytes: A, B, C when
 * beta != 0 and D, as matmul_bf16, and the epilogue's vectors and matrix:
 * the bias read (BIAS, GELU_AUX_BIAS, GELU_BIAS), the GELU input written
 * (GELU_AUX_BIAS) or read (DGELU_BGRAD), the bias gradient written. FLOPs:
 * 2 M N K, plus the epilogue's as the fused kernels count theirs (bias 1,
 * bias + GELU 9, GELU backward and its sum 14 per element of D; the bias
 * gradient of A 1 per element of op(A)). One launch. Its first call that
 * runs after a mimic takes the cuBLASLt workspace from this device's
 * allocator, as the CUDA entry's first call does (device.h), so a plan
 * holds it under tag other; mimic gives it back. */
static pthread_mutex_t workspace_mu = PTHREAD_MUTEX_INITIALIZER;
static void *g_workspace;

static bool meta_lt_workspace(void) {
    pthread_mutex_lock(&workspace_mu);
    if (!g_workspace &&
        fsdp_alloc(FSDP_DEVICE_META, FSDP_TAG_OTHER, FSDP_EPILOGUE_WORKSPACE_BYTES, &g_workspace) != FSDP_OK)
        g_workspace = NULL;
    bool have = g_workspace != NULL;
    pthread_mutex_unlock(&workspace_mu);
    return have;
}

static void meta_lt_workspace_release(void) {
    pthread_mutex_lock(&workspace_mu);
    if (g_workspace) fsdp_free(FSDP_DEVICE_META, FSDP_TAG_OTHER, g_workspace, FSDP_EPILOGUE_WORKSPACE_BYTES);
    g_workspace = NULL;
    pthread_mutex_unlock(&workspace_mu);
}

static int meta_matmul_epilogue_bf16(uint16_t *d, const uint16_t *a, const uint16_t *b, const uint16_t *c, int64_t M,
                                     int64_t N, int64_t K, int trans_a, int trans_b, float alpha, float beta,
                                     int epilogue, const uint16_t *bias, uint16_t *aux, uint16_t *dbias) {
    (void)trans_a;
    (void)trans_b;
    if (!matmul_epilogue_covers(d, a, b, c, M, N, K, alpha, beta, epilogue, bias, aux, dbias)) return 0;
    if (!meta_lt_workspace()) return 0;
    int64_t mn = M * N, rd = BF16 * (M * K + K * N + (beta != 0) * mn), wr = BF16 * mn, fl = 2 * M * N * K;
    switch (epilogue) {
    case FSDP_EPILOGUE_BIAS: rd += BF16 * N, fl += mn; break;
    case FSDP_EPILOGUE_GELU_AUX_BIAS: rd += BF16 * N, wr += BF16 * mn, fl += 9 * mn; break;
    case FSDP_EPILOGUE_GELU_BIAS: rd += BF16 * N, fl += 9 * mn; break;   /* no GELU input written */
    case FSDP_EPILOGUE_DGELU_BGRAD: rd += BF16 * mn, wr += BF16 * N, fl += 14 * mn; break;
    default: wr += BF16 * M, fl += M * K; break;   /* BGRAD_A */
    }
    record(E_matmul_epilogue_bf16, rd, wr, fl, 1, 0);
    return 1;
}

/* Pinned host memory: real host memory (host code casts into it and adds
 * from it), counted as the pinned blocks a CUDA device would make. The
 * copies are one GPU operation each and no host wait; a fence waited for
 * is one (the host stops until the copy is done), a fence only asked about
 * none. Values copied back are zeros. */
static char meta_fence;   /* every fence: one that has passed */

static void *meta_host_alloc(size_t nbytes) {
    record(E_host_alloc, 0, 0, 0, 0, 0);
    void *p = NULL;
    return posix_memalign(&p, 64, nbytes ? nbytes : 1) == 0 ? p : NULL;
}

/* cudaFreeHost waits for the device: a sync where the meta device mimics one. */
static void meta_host_free(void *ptr) {
    record(E_host_free, 0, 0, 0, 0, 1);
    free(ptr);
}

static void *meta_copy_from_host_async(void *dst, const void *pinned_src, size_t nbytes) {
    (void)dst;
    (void)pinned_src;
    record(E_copy_from_host_async, 0, (int64_t)nbytes, 0, 1, 0);
    return &meta_fence;
}

static void *meta_copy_to_host_async(void *pinned_dst, const void *src, size_t nbytes) {
    (void)src;
    record(E_copy_to_host_async, (int64_t)nbytes, 0, 0, 1, 0);
    memset(pinned_dst, 0, nbytes);
    return &meta_fence;
}

static int meta_fence_wait(void *fence, int block) {
    (void)fence;
    record(E_fence_wait, 0, 0, 0, 0, block ? 1 : 0);
    return 1;
}

/* Every entry this file knows. */
static const fsdp_device_kernels meta_full = {
    .name = "meta",
#define FSDP_KERNEL(ret, name, params, has) .name = meta_##name,
#include "kernels.def"
};

/* What the device offers now: meta_full less what the mimicked device lacks. */
fsdp_device_kernels meta_device_kernels = {
    .name = "meta",
#define FSDP_KERNEL(ret, name, params, has) .name = meta_##name,
#include "kernels.def"
};

static int g_mimic = FSDP_DEVICE_CPU;

/* ---- the table as slots (every member after .name is a function pointer) ---- */

typedef void (*slot_fn)(void);
#define N_SLOTS ((sizeof(fsdp_device_kernels) - offsetof(fsdp_device_kernels, raw_alloc)) / sizeof(slot_fn))
_Static_assert(offsetof(fsdp_device_kernels, raw_alloc) == sizeof(const char *),
               "device.h: the kernel table starts with its name, then function pointers");
_Static_assert((sizeof(fsdp_device_kernels) - sizeof(const char *)) % sizeof(slot_fn) == 0,
               "device.h: the kernel table holds only function pointers after its name");

static slot_fn slot_get(const fsdp_device_kernels *k, size_t i) {
    slot_fn f;
    memcpy(&f, (const char *)k + offsetof(fsdp_device_kernels, raw_alloc) + i * sizeof f, sizeof f);
    return f;
}
static void slot_set(fsdp_device_kernels *k, size_t i, slot_fn f) {
    memcpy((char *)k + offsetof(fsdp_device_kernels, raw_alloc) + i * sizeof f, &f, sizeof f);
}

/* The name of the entry in slot i, or of the nearest one before it this
 * file knows (for messages about entries it does not). */
static const char *slot_name(size_t i, bool *exact) {
    static const struct { const char *name; size_t off; } known[] = {
#define FSDP_KERNEL(ret, name, params, has) {#name, offsetof(fsdp_device_kernels, name)},
#include "kernels.def"
    };
    size_t off = offsetof(fsdp_device_kernels, raw_alloc) + i * sizeof(slot_fn), best = 0;
    const char *name = "name";
    *exact = false;
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++) {
        if (known[k].off == off) {
            *exact = true;
            return known[k].name;
        }
        if (known[k].off < off && known[k].off >= best) {
            best = known[k].off;
            name = known[k].name;
        }
    }
    return name;
}

#ifdef FSDP_HAVE_CUDA
#include "cuda_internal.h"   /* (names the emulation's table in the emulated build) */
extern const fsdp_device_kernels cuda_device_kernels;
#endif

static const fsdp_device_kernels *mimic_table(int device) {
    if (device == FSDP_DEVICE_CPU) return device_kernels(FSDP_DEVICE_CPU);
#ifdef FSDP_HAVE_CUDA
    /* the CUDA table's entry set, whether or not a GPU is there (less the
     * epilogue GEMM under FSDP_CUDA_EPILOGUES=0, as a GPU's start-up does) */
    if (device == FSDP_DEVICE_CUDA) {
        static fsdp_device_kernels cuda_set;
        cuda_set = cuda_device_kernels;
        if (cuda_epilogues_wanted(NULL) == 0) cuda_set.matmul_epilogue_bf16 = NULL;
        return &cuda_set;
    }
#endif
    return NULL;
}

/* ---- public ---- */

fsdp_status fsdp_meta_mimic(fsdp_device device) {
    if (device != FSDP_DEVICE_CPU && device != FSDP_DEVICE_CUDA)
        return fsdp_set_error(FSDP_ERR_DEVICE, "fsdp_meta_mimic: device %d (%s), expected cpu (0) or cuda (1)",
                              device, fsdp_device_name(device));
#ifdef FSDP_HAVE_CUDA
    const char *epi_value = NULL;
    if (device == FSDP_DEVICE_CUDA && cuda_epilogues_wanted(&epi_value) < 0)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_meta_mimic(cuda): FSDP_CUDA_EPILOGUES is \"%s\", expected 1 "
                              "(the default: cuBLASLt's fused epilogues) or 0 (none)", epi_value);
#endif
    const fsdp_device_kernels *target = mimic_table(device);
    if (!target)
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "fsdp_meta_mimic: the CUDA kernel table is not built into this "
                              "engine (no nvcc at build time), so the meta device cannot take its kernel set");
    /* every entry has a counting function here (kernels.def: a missing COST_ line fails the build) */
    for (size_t i = 0; i < N_SLOTS; i++) {
        bool exact;
        const char *nm = slot_name(i, &exact);
        /* memory stays the meta device's own whatever it mimics */
        if (exact && (strcmp(nm, "raw_alloc") == 0 || strcmp(nm, "raw_free") == 0)) continue;
        slot_set(&meta_device_kernels, i, slot_get(target, i) ? slot_get(&meta_full, i) : NULL);
    }
    meta_lt_workspace_release();   /* a new run takes it at its first fused GEMM, as a new process does */
    g_mimic = device;
    return FSDP_OK;
}

fsdp_status fsdp_meta_mimicked(int *device) {
    if (!device) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_meta_mimicked: out is NULL");
    *device = g_mimic;
    return FSDP_OK;
}

fsdp_status fsdp_meta_reset(void) {
    pthread_mutex_lock(&counts_mu);
    memset(counts, 0, sizeof counts);
    pthread_mutex_unlock(&counts_mu);
    return FSDP_OK;
}

fsdp_status fsdp_meta_entry_count(int *n) {
    if (!n) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_meta_entry_count: out is NULL");
    *n = E_COUNT;
    return FSDP_OK;
}

fsdp_status fsdp_meta_entry(int i, const char **name, const char **family, int *present, int64_t *counters) {
    if (i < 0 || i >= E_COUNT)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_meta_entry: entry %d, expected 0..%d", i, E_COUNT - 1);
    if (name) *name = entry_names[i];
    if (family) *family = entry_families[i];
    if (present) {
        bool exact = false;
        *present = 0;
        for (size_t s = 0; s < N_SLOTS; s++)
            if (strcmp(slot_name(s, &exact), entry_names[i]) == 0 && exact) {
                *present = slot_get(&meta_device_kernels, s) != NULL;
                break;
            }
    }
    if (counters) {
        pthread_mutex_lock(&counts_mu);
        const entry_counts *c = &counts[i];
        counters[0] = c->calls;
        counters[1] = c->bytes_read;
        counters[2] = c->bytes_written;
        counters[3] = c->flops;
        counters[4] = c->launches;
        counters[5] = c->syncs;
        counters[6] = c->bytes_l2;
        pthread_mutex_unlock(&counts_mu);
    }
    return FSDP_OK;
}

/* ---- the device as it registers itself ---- */

static fsdp_status meta_info(int *available, char *desc, int64_t size) {
    *available = 1;
    if (desc && size > 0)
        snprintf(desc, (size_t)size, "meta (counts, computes nothing; the %s kernel set)", fsdp_device_name(g_mimic));
    return FSDP_OK;
}
/* host code may touch its memory only as the CPU's: when it mimics the CPU
 * (its buffers are never read then: PROT_NONE pages fault at once) */
static bool meta_host_like(void) { return g_mimic == FSDP_DEVICE_CPU; }
static const device_backend meta_backend = {meta_info, meta_host_like};

__attribute__((constructor)) static void meta_device_register(void) {
    device_register(FSDP_DEVICE_META, &meta_device_kernels);
    device_register_backend(FSDP_DEVICE_META, &meta_backend);
}
