/* matmul_dnnl.c: batched matmuls on oneDNN's matmul primitive (f32, and
 * bf16 x bf16 with f32 accumulation), with the same contract as
 * cpu_matmul_f32 (cpu_kernels.h).
 *
 * Creating a primitive costs far more than running a small one, so each
 * (dtype, shape, transposes, strides, alpha, beta) gets its primitive (and,
 * where B is reordered first, the reorder and its buffer) once
 * and keeps it in a small cache; a step of a model reuses a few dozen shapes.
 * The Debian build of oneDNN threads with OpenMP, so the calling thread's
 * OpenMP team size is set to the engine's thread count before each call.
 *
 * oneDNN is opened at run time (dlopen), not linked: a machine without it
 * runs every matmul on OpenBLAS, and OpenMP's wait policy can be chosen
 * before OpenMP starts. By default OpenMP workers spin for milliseconds
 * after each parallel region, which takes a core from the engine's own pool
 * (and from the other ranks sharing the host) after every matmul; so unless
 * the user chose (OMP_WAIT_POLICY, GOMP_SPINCOUNT), they sleep at once.
 *
 * Every failure (no CPU engine, an unsupported shape or dtype, a creation or
 * execution error) returns non-zero and the caller takes the OpenBLAS path,
 * so a oneDNN problem costs speed, never a result. */
#include "cpu_kernels.h"

#ifdef FSDP_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CACHE_SIZE 96
/* products of fewer multiply-adds (M*N*K*batch) run on one thread */
#define SMALL_MNK (1 << 21)

typedef struct {
    /* key */
    int bf16, nthreads;
    int64_t batch, M, N, K, sa, sb, sc;
    int ta, tb;
    float alpha, beta;
    int pack_b;            /* B reordered to the layout oneDNN picks before each product (pack_b_pays) */
    int64_t lda;           /* A's row stride when it is a column block of a wider A (K chunks), else 0 */
    int c_f32;             /* bf16 A and B, f32 C (a bf16 product's K chunks accumulate in f32) */
    /* value */
    int used;              /* the slot holds this key */
    int failed;            /* oneDNN cannot do this key: callers use OpenBLAS */
    uint64_t last_use;
    dnnl_primitive_t prim;
    dnnl_memory_t ma, mb, mc;
    dnnl_primitive_t reorder_b;   /* pack_b: B as stored -> b_packed */
    dnnl_memory_t b_packed;
} mm_entry;

static struct {
    pthread_mutex_t lock;
    pthread_once_t once;
    int ok;                /* engine and stream exist */
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    uint64_t clock;
    mm_entry cache[CACHE_SIZE];
    int warned;
} dn = {.lock = PTHREAD_MUTEX_INITIALIZER, .once = PTHREAD_ONCE_INIT};

/* The oneDNN (and OpenMP) functions used here, looked up in libdnnl.so.2. */
#define DNNL_FUNCTIONS(X)                                                                                   \
    X(dnnl_engine_create) X(dnnl_engine_destroy) X(dnnl_stream_create) X(dnnl_stream_wait)                 \
    X(dnnl_memory_desc_init_by_strides) X(dnnl_matmul_desc_init) X(dnnl_primitive_attr_create)            \
    X(dnnl_primitive_attr_destroy) X(dnnl_primitive_attr_set_output_scales) X(dnnl_post_ops_create)       \
    X(dnnl_post_ops_destroy) X(dnnl_post_ops_append_sum) X(dnnl_primitive_attr_set_post_ops)              \
    X(dnnl_primitive_desc_create) X(dnnl_primitive_desc_destroy) X(dnnl_primitive_desc_query)             \
    X(dnnl_primitive_create) X(dnnl_primitive_destroy) X(dnnl_memory_create) X(dnnl_memory_destroy)       \
    X(dnnl_memory_set_data_handle) X(dnnl_primitive_execute) X(dnnl_memory_desc_init_by_tag)               \
    X(dnnl_primitive_desc_query_md) X(dnnl_reorder_primitive_desc_create) X(dnnl_memory_desc_equal)

static struct {
#define X(name) __typeof__(name) *name;
    DNNL_FUNCTIONS(X)
#undef X
    void (*omp_set_num_threads)(int);
    int (*omp_get_max_threads)(void);
} fn;

/* Before anything can start OpenMP: workers that sleep when idle. */
__attribute__((constructor)) static void omp_wait_policy_default(void) {
    if (!getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT")) setenv("OMP_WAIT_POLICY", "PASSIVE", 0);
}

static int dn_open(void) {
    void *lib = dlopen("libdnnl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 0;
#define X(name) if (!(fn.name = (__typeof__(name) *)dlsym(lib, #name))) return 0;
    DNNL_FUNCTIONS(X)
#undef X
    *(void **)&fn.omp_set_num_threads = dlsym(lib, "omp_set_num_threads");
    *(void **)&fn.omp_get_max_threads = dlsym(lib, "omp_get_max_threads");
    return fn.omp_set_num_threads && fn.omp_get_max_threads;
}

static void dn_init(void) {
    if (getenv("FSDP_NO_DNNL") && atoi(getenv("FSDP_NO_DNNL")) > 0) return;
    if (!dn_open()) return;
    if (fn.dnnl_engine_create(&dn.engine, dnnl_cpu, 0) != dnnl_success) return;
    if (fn.dnnl_stream_create(&dn.stream, dn.engine, dnnl_stream_default_flags) != dnnl_success) {
        fn.dnnl_engine_destroy(dn.engine);
        return;
    }
    dn.ok = 1;
}

static void entry_clear(mm_entry *e) {
    if (e->prim) fn.dnnl_primitive_destroy(e->prim);
    if (e->ma) fn.dnnl_memory_destroy(e->ma);
    if (e->mb) fn.dnnl_memory_destroy(e->mb);
    if (e->mc) fn.dnnl_memory_destroy(e->mc);
    if (e->reorder_b) fn.dnnl_primitive_destroy(e->reorder_b);
    if (e->b_packed) fn.dnnl_memory_destroy(e->b_packed);
    memset(e, 0, sizeof *e);
}

/* Logical (batch, rows, cols) of a stored matrix that is (rows, cols), or
 * (cols, rows) when trans; batch 1 (broadcast) when its batch stride is 0. */
static dnnl_status_t matrix_md(dnnl_memory_desc_t *md, int ndims, int64_t batch, int64_t stride, int64_t rows,
                               int64_t cols, int trans, dnnl_data_type_t dt) {
    dnnl_dims_t dims, strides;
    int k = 0;
    if (ndims == 3) {
        dims[k] = stride == 0 ? 1 : batch;
        strides[k++] = stride == 0 ? rows * cols : stride;
    }
    dims[k] = rows;
    strides[k++] = trans ? 1 : cols;
    dims[k] = cols;
    strides[k++] = trans ? rows : 1;
    return fn.dnnl_memory_desc_init_by_strides(md, ndims, dims, dt, strides);
}

static int entry_create(mm_entry *e) {
    dnnl_data_type_t dt = e->bf16 ? dnnl_bf16 : dnnl_f32;
    int nd = e->batch > 1 ? 3 : 2;
    dnnl_memory_desc_t a_md, b_md, c_md, b_any;
    dnnl_matmul_desc_t desc;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL, rpd = NULL;
    int ok = 0;
    if (matrix_md(&a_md, nd, e->batch, e->sa, e->M, e->K, e->ta, dt) != dnnl_success) goto out;
    if (e->lda) {   /* (batch 1, A as stored) */
        dnnl_dims_t dims = {e->M, e->K}, strides = {e->lda, 1};
        if (fn.dnnl_memory_desc_init_by_strides(&a_md, 2, dims, dt, strides) != dnnl_success) goto out;
    }
    if (matrix_md(&b_md, nd, e->batch, e->sb, e->K, e->N, e->tb, dt) != dnnl_success) goto out;
    if (matrix_md(&c_md, nd, e->batch, e->sc, e->M, e->N, 0, e->c_f32 ? dnnl_f32 : dt) != dnnl_success) goto out;
    if (e->pack_b) {   /* (batch 1 only) the product picks B's layout */
        dnnl_dims_t dims = {e->K, e->N};
        if (fn.dnnl_memory_desc_init_by_tag(&b_any, 2, dims, dt, dnnl_format_tag_any) != dnnl_success) goto out;
    }
    if (fn.dnnl_matmul_desc_init(&desc, &a_md, e->pack_b ? &b_any : &b_md, NULL, &c_md) != dnnl_success) goto out;
    if (fn.dnnl_primitive_attr_create(&attr) != dnnl_success) goto out;
    if (e->alpha != 1.0f && fn.dnnl_primitive_attr_set_output_scales(attr, 1, 0, &e->alpha) != dnnl_success) goto out;
    if (e->beta != 0.0f) {
        if (fn.dnnl_post_ops_create(&po) != dnnl_success) goto out;
        if (fn.dnnl_post_ops_append_sum(po, e->beta) != dnnl_success) goto out;
        if (fn.dnnl_primitive_attr_set_post_ops(attr, po) != dnnl_success) goto out;
    }
    if (fn.dnnl_primitive_desc_create(&pd, &desc, attr, dn.engine, NULL) != dnnl_success) goto out;
    if (fn.dnnl_primitive_create(&e->prim, pd) != dnnl_success) goto out;
    if (e->pack_b) {
        const dnnl_memory_desc_t *packed = fn.dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
        if (!packed) goto out;
        if (!fn.dnnl_memory_desc_equal(packed, &b_md)) {   /* (else it chose B as stored: no reorder) */
            if (fn.dnnl_reorder_primitive_desc_create(&rpd, &b_md, dn.engine, packed, dn.engine, NULL) != dnnl_success)
                goto out;
            if (fn.dnnl_primitive_create(&e->reorder_b, rpd) != dnnl_success) goto out;
            if (fn.dnnl_memory_create(&e->b_packed, packed, dn.engine, DNNL_MEMORY_ALLOCATE) != dnnl_success) goto out;
        }
    }
    /* placeholders: the data handles are set on every call */
    if (fn.dnnl_memory_create(&e->ma, &a_md, dn.engine, DNNL_MEMORY_NONE) != dnnl_success) goto out;
    if (fn.dnnl_memory_create(&e->mb, &b_md, dn.engine, DNNL_MEMORY_NONE) != dnnl_success) goto out;
    if (fn.dnnl_memory_create(&e->mc, &c_md, dn.engine, DNNL_MEMORY_NONE) != dnnl_success) goto out;
    ok = 1;
out:
    if (rpd) fn.dnnl_primitive_desc_destroy(rpd);
    if (pd) fn.dnnl_primitive_desc_destroy(pd);
    if (po) fn.dnnl_post_ops_destroy(po);
    if (attr) fn.dnnl_primitive_attr_destroy(attr);
    return ok;
}

/* The slot for a key: a hit, or the least recently used slot rebuilt. */
static mm_entry *cache_get(const mm_entry *key) {
    mm_entry *lru = &dn.cache[0];
    for (int i = 0; i < CACHE_SIZE; i++) {
        mm_entry *e = &dn.cache[i];
        if (e->used && e->bf16 == key->bf16 && e->nthreads == key->nthreads && e->batch == key->batch && e->M == key->M && e->N == key->N &&
            e->K == key->K && e->sa == key->sa && e->sb == key->sb && e->sc == key->sc && e->ta == key->ta &&
            e->tb == key->tb && e->alpha == key->alpha && e->beta == key->beta && e->pack_b == key->pack_b &&
            e->lda == key->lda && e->c_f32 == key->c_f32)
            return e;
        if (!e->used || (lru->used && e->last_use < lru->last_use)) lru = e;
    }
    entry_clear(lru);
    *lru = *key;
    lru->used = 1;
    lru->prim = NULL;
    lru->ma = lru->mb = lru->mc = NULL;
    if (!entry_create(lru)) lru->failed = 1;   /* what was made is freed with the slot */
    return lru;
}

static void warn_once(const mm_entry *k, const char *what) {
    if (dn.warned) return;
    dn.warned = 1;
    fprintf(stderr,
            "fsdp: oneDNN matmul %s (%s, batch %lld, M %lld, N %lld, K %lld, trans_a %d, trans_b %d): %s; "
            "such matmuls use OpenBLAS in f32\n",
            k->bf16 ? "bf16" : "f32", k->bf16 ? "bf16 x bf16 -> bf16" : "f32 x f32 -> f32", (long long)k->batch,
            (long long)k->M, (long long)k->N, (long long)k->K, k->ta, k->tb, what);
}

/* f32 with B read as stored and wide (N >= 2560; the MLP projection's dX,
 * dY (256, 768) @ W (768, 3072)): oneDNN's f32 kernel reads such a B in
 * place and runs at half its usual rate (43 GFLOP/s against 104 with B
 * in its own layout, same run, the reorder 2.5 ms of the product's 11.6), so
 * B is reordered first, as OpenBLAS packs it. bf16 packs B itself. */
#define PACK_B_MIN_N 2560

static int pack_b_pays(int bf16, int64_t batch, int64_t N, int trans_b) {
    return !bf16 && batch == 1 && !trans_b && N >= PACK_B_MIN_N;
}

/* One product on a cached entry (under dn.lock); 0 on success. */
static int entry_run(mm_entry *e, void *c, const void *a, const void *b) {
    if (e->failed) {
        warn_once(e, "no implementation for this shape");
        return -1;
    }
    fn.dnnl_memory_set_data_handle(e->ma, (void *)a);
    fn.dnnl_memory_set_data_handle(e->mb, (void *)b);
    fn.dnnl_memory_set_data_handle(e->mc, c);
    dnnl_exec_arg_t pack[2] = {{DNNL_ARG_FROM, e->mb}, {DNNL_ARG_TO, e->b_packed}};
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, e->ma}, {DNNL_ARG_WEIGHTS, e->reorder_b ? e->b_packed : e->mb},
                               {DNNL_ARG_DST, e->mc}};
    if ((!e->reorder_b || fn.dnnl_primitive_execute(e->reorder_b, dn.stream, 2, pack) == dnnl_success) &&
        fn.dnnl_primitive_execute(e->prim, dn.stream, 3, args) == dnnl_success &&
        fn.dnnl_stream_wait(dn.stream) == dnnl_success)
        return 0;
    warn_once(e, "execution failed");
    e->failed = 1;
    return -1;
}

static mm_entry *entry_for(const mm_entry *key) {
    mm_entry *e = cache_get(key);
    e->last_use = ++dn.clock;
    return e;
}

/* A deep K (the tied LM head's dX: dlogits (256, 50304) @ wte (50304, 768)):
 * oneDNN runs the whole K at 108 GFLOP per CPU second in f32, and as a sum
 * of products over chunks of 4096 of K at 154 (same run, alone; bf16 on
 * AMX 1.4x likewise). The first chunk writes C, the others add into it
 * (beta 1) in f32, as any GEMM's K blocking does: for bf16 into an f32
 * scratch C, rounded to bf16 once at the end. Only C = alpha * A @ B
 * (beta 0) is split, so a failure part way leaves nothing the fallback
 * reads. */
#define K_CHUNK 4096
#define DEEP_K_MIN 16384

static int k_chunks_pay(const mm_entry *k) {
    int64_t wide = k->M > k->N ? k->M : k->N;
    return k->batch == 1 && !k->ta && !k->tb && k->beta == 0.0f && k->K >= DEEP_K_MIN && k->K >= 16 * wide;
}

static int run_k_chunks(const mm_entry *key, void *c, const void *a, const void *b) {
    int64_t K = key->K, n = (K + K_CHUNK - 1) / K_CHUNK, rest = K - (n - 1) * K_CHUNK;
    mm_entry kfirst = *key, kmid = *key, klast = *key;
    kfirst.K = kmid.K = K_CHUNK;
    klast.K = rest;
    kfirst.lda = kmid.lda = klast.lda = K;
    kmid.beta = klast.beta = 1.0f;
    kfirst.pack_b = kmid.pack_b = klast.pack_b = 0;
    kfirst.c_f32 = kmid.c_f32 = klast.c_f32 = key->bf16;
    /* all three made before any runs; each was just used, so none evicts another */
    mm_entry *first = entry_for(&kfirst), *mid = entry_for(&kmid), *last = entry_for(&klast);
    if (first->failed || mid->failed || last->failed) {
        warn_once(first->failed ? first : mid->failed ? mid : last, "no implementation for this shape");
        return -1;
    }
    float *acc = key->bf16 ? malloc((size_t)(key->M * key->N) * sizeof *acc) : c;   // (M, N) f32
    if (!acc) return -1;
    size_t esz = key->bf16 ? sizeof(uint16_t) : sizeof(float);
    int rc = 0;
    for (int64_t i = 0; i < n && rc == 0; i++) {
        mm_entry *e = i == 0 ? first : i == n - 1 ? last : mid;
        int64_t k0 = i * K_CHUNK;
        /* A's columns k0.. (row stride K), B's rows k0.. */
        rc = entry_run(e, acc, (const char *)a + (size_t)k0 * esz, (const char *)b + (size_t)(k0 * key->N) * esz);
    }
    if (key->bf16) {
        if (rc == 0) cpu_cast_f32_to_bf16(c, acc, key->M * key->N);
        free(acc);
    }
    return rc;
}

int cpu_matmul_dnnl(int bf16, void *c, const void *a, const void *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                    int trans_a, int trans_b, float alpha, float beta, int64_t stride_a, int64_t stride_b,
                    int64_t stride_c) {
    pthread_once(&dn.once, dn_init);
    if (!dn.ok) return -1;
    /* oneDNN has no empty inner dimension, and C's batches must not alias */
    if (K <= 0 || M <= 0 || N <= 0 || batch <= 0 || (batch > 1 && stride_c < M * N)) return -1;
    if (batch == 1) stride_a = stride_b = stride_c = 0;
    mm_entry key = {.bf16 = bf16, .batch = batch, .M = M, .N = N, .K = K, .sa = stride_a, .sb = stride_b,
                    .sc = stride_c, .ta = trans_a != 0, .tb = trans_b != 0, .alpha = alpha, .beta = beta,
                    .pack_b = pack_b_pays(bf16, batch, N, trans_b)};
    /* A small product is not worth waking a team for: the fork-join costs
     * more than the work, and far more when the cores are shared. */
    int nt = (double)M * N * K * batch < SMALL_MNK ? 1 : cpu_threads_get();
    key.nthreads = nt;
    pthread_mutex_lock(&dn.lock);
    /* oneDNN sizes its work split by the team at creation, so set it first */
    if (fn.omp_get_max_threads() != nt) fn.omp_set_num_threads(nt);
    int rc = k_chunks_pay(&key) ? run_k_chunks(&key, c, a, b) : entry_run(entry_for(&key), c, a, b);
    pthread_mutex_unlock(&dn.lock);
    return rc;
}

const char *cpu_matmul_dnnl_impl(int bf16, int64_t M, int64_t N, int64_t K) {
    static char name[64];
    pthread_once(&dn.once, dn_init);
    if (!dn.ok) return "none";
    dnnl_memory_desc_t a_md, b_md, c_md;
    dnnl_matmul_desc_t desc;
    dnnl_primitive_desc_t pd;
    dnnl_data_type_t dt = bf16 ? dnnl_bf16 : dnnl_f32;
    matrix_md(&a_md, 2, 1, 0, M, K, 0, dt);
    matrix_md(&b_md, 2, 1, 0, K, N, 0, dt);
    matrix_md(&c_md, 2, 1, 0, M, N, 0, dt);
    if (fn.dnnl_matmul_desc_init(&desc, &a_md, &b_md, NULL, &c_md) != dnnl_success ||
        fn.dnnl_primitive_desc_create(&pd, &desc, NULL, dn.engine, NULL) != dnnl_success)
        return "none";
    const char *impl = NULL;
    fn.dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
    snprintf(name, sizeof name, "%s", impl ? impl : "?");
    fn.dnnl_primitive_desc_destroy(pd);
    return name;
}

#else

int cpu_matmul_dnnl(int bf16, void *c, const void *a, const void *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                    int trans_a, int trans_b, float alpha, float beta, int64_t stride_a, int64_t stride_b,
                    int64_t stride_c) {
    (void)bf16, (void)c, (void)a, (void)b, (void)batch, (void)M, (void)N, (void)K, (void)trans_a, (void)trans_b;
    (void)alpha, (void)beta, (void)stride_a, (void)stride_b, (void)stride_c;
    return -1;
}

const char *cpu_matmul_dnnl_impl(int bf16, int64_t M, int64_t N, int64_t K) {
    (void)bf16, (void)M, (void)N, (void)K;
    return "none";
}

#endif

int cpu_matmul_dnnl_available(void) {
#ifdef FSDP_HAVE_DNNL
    pthread_once(&dn.once, dn_init);
    return dn.ok;
#else
    return 0;
#endif
}
