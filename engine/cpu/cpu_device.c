/* cpu_device.c: the CPU's kernel table (see device.h). */
#include "cpu_kernels.h"
#include "device.h"
#include "internal.h"
#include <stdlib.h>
#include <string.h>

/* From the host heap once it is on (ranks sharing a host read each other's
 * buffers there, comm_shm.c), else private memory. */
static void *host_raw_alloc(size_t nbytes) {
    void *p = host_heap_alloc(nbytes);
    return p ? p : aligned_alloc(64, nbytes);
}
static void host_raw_free(void *ptr) {
    if (!host_heap_free(ptr)) free(ptr);
}
static void host_copy_from_host(void *dst, const void *src, size_t nbytes) { memcpy(dst, src, nbytes); }
static void host_copy_to_host(void *dst, const void *src, size_t nbytes) { memcpy(dst, src, nbytes); }
static void host_synchronize(void) {}

const fsdp_device_kernels cpu_device_kernels = {
    .name = "cpu",
    .raw_alloc = host_raw_alloc,
    .raw_free = host_raw_free,
    .zero = cpu_zero,
    .copy_from_host = host_copy_from_host,
    .copy_to_host = host_copy_to_host,
    .synchronize = host_synchronize,
    .cast_any = cpu_cast_any,
    .copy_strided = cpu_copy_strided,
    .fill_f32 = cpu_fill_f32,
    .matmul_f32 = cpu_matmul_f32,
    .matmul_bf16 = cpu_matmul_bf16,
    .binary_f32 = cpu_binary_f32,
    .scale_f32 = cpu_scale_f32,
    .add_scalar_f32 = cpu_add_scalar_f32,
    .axpy_f32 = cpu_axpy_f32,
    .axpy_f32_bf16 = cpu_axpy_f32_bf16,
    .sum_dim_f32 = cpu_sum_dim_f32,
    .sum_dim_bf16 = cpu_sum_dim_bf16,
    .sum_dim_acc_bf16 = cpu_sum_dim_acc_bf16,
    .sum_all_f32 = cpu_sum_all_f32,
    .sumsq_f32 = cpu_sumsq_f32,
    .binary_bf16 = cpu_binary_bf16,
    .gelu_forward_f32 = cpu_gelu_forward_f32,
    .gelu_backward_f32 = cpu_gelu_backward_f32,
    .silu_forward_f32 = cpu_silu_forward_f32,
    .silu_backward_f32 = cpu_silu_backward_f32,
    .softmax_forward_f32 = cpu_softmax_forward_f32,
    .softmax_backward_f32 = cpu_softmax_backward_f32,
    .log_softmax_forward_f32 = cpu_log_softmax_forward_f32,
    .log_softmax_backward_f32 = cpu_log_softmax_backward_f32,
    .gelu_forward_bf16 = cpu_gelu_forward_bf16,
    .gelu_backward_bf16 = cpu_gelu_backward_bf16,
    .layernorm_forward_f32 = cpu_layernorm_forward_f32,
    .layernorm_backward_f32 = cpu_layernorm_backward_f32,
    .rmsnorm_forward_f32 = cpu_rmsnorm_forward_f32,
    .rmsnorm_backward_f32 = cpu_rmsnorm_backward_f32,
    .layernorm_forward_bf16 = cpu_layernorm_forward_bf16,
    .layernorm_backward_bf16 = cpu_layernorm_backward_bf16,
    .embedding_forward_f32 = cpu_embedding_forward_f32,
    .embedding_backward_f32 = cpu_embedding_backward_f32,
    .embedding_backward_bf16 = cpu_embedding_backward_bf16,
    .embedding_backward_acc_bf16 = cpu_embedding_backward_acc_bf16,
    .embedding_backward_acc_f32 = cpu_embedding_backward_acc_f32,
    .cross_entropy_forward_f32 = cpu_cross_entropy_forward_f32,
    .cross_entropy_backward_f32 = cpu_cross_entropy_backward_f32,
    .attention_forward_f32 = cpu_attention_forward_f32,
    .attention_backward_f32 = cpu_attention_backward_f32,
    .cross_entropy_forward_bf16 = cpu_cross_entropy_forward_bf16,
    .cross_entropy_backward_bf16 = cpu_cross_entropy_backward_bf16,
    .cross_entropy_fused_f32 = cpu_cross_entropy_fused_f32,
    .cross_entropy_fused_bf16 = cpu_cross_entropy_fused_bf16,
    .classifier_lse_f32 = cpu_classifier_lse_f32,
    .classifier_finish_f32 = cpu_classifier_finish_f32,
    .classifier_dlogits_f32 = cpu_classifier_dlogits_f32,
    .embedding_slice_forward_f32 = cpu_embedding_slice_forward_f32,
    .embedding_slice_backward_f32 = cpu_embedding_slice_backward_f32,
    .init_normal_f32 = cpu_init_normal_f32,
    .init_uniform_f32 = cpu_init_uniform_f32,
    .dropout_f32 = cpu_dropout_f32,
    .adamw_f32 = cpu_adamw_f32,
    .sgd_f32 = cpu_sgd_f32,
    .bias_gelu_forward_f32 = cpu_bias_gelu_forward_f32,
    .bias_gelu_forward_bf16 = cpu_bias_gelu_forward_bf16,
    .bias_gelu_backward_f32 = cpu_bias_gelu_backward_f32,
    .bias_gelu_backward_bf16 = cpu_bias_gelu_backward_bf16,
    .bias_residual_f32 = cpu_bias_residual_f32,
    .bias_residual_bf16 = cpu_bias_residual_bf16,
};
