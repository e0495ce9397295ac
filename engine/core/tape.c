/* tape.c: the autograd tape (DESIGN.md, decision 3).
 *
 * Ops run with gradients enabled append a node: the op's inputs and outputs
 * (retained) and a C backward function. Backward walks the nodes in reverse,
 * which is a topological order, accumulating each tensor's gradient in its
 * bgrad field; leaves get theirs added into .grad. A node recorded by Lua
 * (custom_id >= 0) has no C backward: the walk pauses there and returns the
 * id, the caller runs the Lua backward and steps again, so no C-to-Lua
 * callback is ever made. Tapes stack: a nested forward (recomputation in
 * activation checkpointing) records and runs backward on its own tape while
 * the outer backward is paused. */
#include "internal.h"
#include "trace.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct tape {
    fsdp_node **nodes;
    int64_t n, cap;
    int64_t since_sweep;         /* records since the last sweep for dead nodes */
    /* backward in progress */
    bool in_backward;
    int64_t pos;                 /* next node to visit, walking down */
    fsdp_node *paused;           /* custom node whose Lua backward is running */
    bool grad_mode_before_pause;
    /* run after a completed backward walk */
    int n_finish;
    struct { fsdp_status (*fn)(void *); void *ctx; void (*release)(void *); } finish[16];
    /* gradients of this walk whose every element the host knows (retained:
     * a later add into one copies it first; and the storage's version at
     * the time, so that a write into it in place, a Lua backward's, say,
     * makes the value unknown) */
    int n_known;
    struct { fsdp_tensor *g; double v; uint64_t version; } known[8];
    struct tape *below;
} tape;

static _Thread_local tape *top;
static _Thread_local bool grad_enabled = true;
static _Thread_local int op_device = FSDP_DEVICE_CPU;

int fsdp_op_device(void) { return op_device; }
void fsdp_set_op_device(int device) { op_device = device; }

/* A node's device: that of its first tensor. */
static int node_device(const fsdp_node *node) {
    for (int i = 0; i < node->n_in; i++)
        if (node->in[i]) return tensor_device(node->in[i]);
    return node->n_out ? tensor_device(node->out[0]) : FSDP_DEVICE_CPU;
}

static tape *current_tape(void) {
    if (!top) top = calloc(1, sizeof(tape));
    return top;
}

static void node_free(fsdp_node *node) {
    if (node->marker_release) node->marker_release(node->marker_ctx);
    for (int i = 0; i < node->n_in; i++) tensor_release(node->in[i]);
    for (int i = 0; i < node->n_out; i++) {
        node->out[i]->graph_freed = true;   /* a later backward from it has nothing to walk */
        tensor_release(node->out[i]);
    }
    for (int i = 0; i < FSDP_NODE_MAX_SAVED; i++) tensor_release(node->saved[i]);
    free(node);
}

static void drop_bgrads(fsdp_node *node) {
    for (int i = 0; i < node->n_out; i++) {
        tensor_release(node->out[i]->bgrad);
        node->out[i]->bgrad = NULL;
    }
}

static void tape_reset(tape *tp) {
    if (tp->paused) grad_enabled = tp->grad_mode_before_pause;   /* a paused Lua backward turned it off */
    for (int64_t k = 0; k < tp->n; k++) {
        if (tp->nodes[k]) {
            drop_bgrads(tp->nodes[k]);
            node_free(tp->nodes[k]);
        }
    }
    tp->n = 0;
    tp->in_backward = false;
    tp->paused = NULL;
    tp->pos = -1;
    for (int k = 0; k < tp->n_finish; k++)
        if (tp->finish[k].release) tp->finish[k].release(tp->finish[k].ctx);
    tp->n_finish = 0;
    for (int k = 0; k < tp->n_known; k++) tensor_release(tp->known[k].g);
    tp->n_known = 0;
}

/* Runs the finish hooks of a completed walk; the first failure wins but
 * every hook runs (each releases what it holds). */
static fsdp_status run_finish_hooks(tape *tp) {
    fsdp_status st = FSDP_OK;
    char msg[4096] = "";
    int n = tp->n_finish;
    tp->n_finish = 0;
    for (int k = 0; k < n; k++) {
        fsdp_status s = tp->finish[k].fn(tp->finish[k].ctx);
        if (s != FSDP_OK && st == FSDP_OK) {
            st = s;
            snprintf(msg, sizeof msg, "%s", fsdp_last_error());
        }
        if (tp->finish[k].release) tp->finish[k].release(tp->finish[k].ctx);
    }
    if (st != FSDP_OK) fsdp_set_error(st, "%s", msg);
    return st;
}

/* A node none of whose outputs is referenced outside the tape can never
 * take part in a backward: drop it, which may free its inputs' nodes too.
 * Walking down visits consumers before producers. */
static void sweep_dead_nodes(tape *tp) {
    int64_t kept = 0;
    for (int64_t k = tp->n - 1; k >= 0; k--) {
        fsdp_node *node = tp->nodes[k];
        bool alive = false;
        for (int i = 0; i < node->n_out; i++)
            if (atomic_load(&node->out[i]->refcount) > 1) alive = true;
        if (!alive && node->custom_id < 0 && !node->marker) {
            node_free(node);
            tp->nodes[k] = NULL;
        }
    }
    for (int64_t k = 0; k < tp->n; k++)
        if (tp->nodes[k]) tp->nodes[kept++] = tp->nodes[k];
    tp->n = kept;
    tp->since_sweep = 0;
}

bool tape_wants(int n_in, fsdp_tensor *const *in) {
    if (!grad_enabled) return false;
    for (int i = 0; i < n_in; i++)
        if (in[i] && in[i]->requires_grad) return true;
    return false;
}

fsdp_node *tape_record(const char *op, fsdp_backward_fn fn, int n_in, fsdp_tensor *const *in, int n_out,
                       fsdp_tensor *const *out) {
    tape *tp = current_tape();
    if (!tp) {
        fsdp_set_error(FSDP_ERR_OOM, "%s: out of host memory for the tape", op);
        return NULL;
    }
    if (tp->in_backward) {
        fsdp_set_error(FSDP_ERR_STATE, "%s: cannot record on a tape during its backward; push a tape first", op);
        return NULL;
    }
    if (tp->since_sweep >= 4096) sweep_dead_nodes(tp);
    if (tp->n == tp->cap) {
        int64_t cap = tp->cap ? tp->cap * 2 : 256;
        fsdp_node **nodes = realloc(tp->nodes, (size_t)cap * sizeof *nodes);
        if (!nodes) {
            fsdp_set_error(FSDP_ERR_OOM, "%s: out of host memory for the tape", op);
            return NULL;
        }
        tp->nodes = nodes;
        tp->cap = cap;
    }
    fsdp_node *node = calloc(1, sizeof *node);
    if (!node) {
        fsdp_set_error(FSDP_ERR_OOM, "%s: out of host memory for a tape node", op);
        return NULL;
    }
    node->op = op;
    node->backward = fn;
    node->custom_id = -1;
    node->n_in = n_in;
    node->n_out = n_out;
    for (int i = 0; i < n_in; i++) {
        node->in[i] = in[i];
        tensor_retain(in[i]);
    }
    for (int i = 0; i < n_out; i++) {
        node->out[i] = out[i];
        tensor_retain(out[i]);
        out[i]->requires_grad = true;
        out[i]->is_leaf = false;
    }
    tp->nodes[tp->n++] = node;
    tp->since_sweep++;
    return node;
}

fsdp_tensor *node_grad_out(fsdp_node *node, int i) { return node->out[i]->bgrad; }

bool node_needs_grad(fsdp_node *node, int i) { return node->in[i] && node->in[i]->requires_grad; }

/* Elements per f32 staging chunk of a gradient accumulation (4 MiB). */
#define ADD_STAGE_ELEMS ((int64_t)1 << 20)

/* acc += g, where acc is contiguous and g has acc's shape. */
static fsdp_status add_into(fsdp_tensor *acc, fsdp_tensor *g) {
    int64_t n = tensor_numel(acc);
    storage_written(acc->storage);
    if (acc->dtype == FSDP_F32 && g->dtype == FSDP_F32 && tensor_is_contiguous(acc) && tensor_is_contiguous(g)) {
        KERNELS(acc)->axpy_f32(tensor_data(acc), tensor_data(g), 1.0f, n);
        return FSDP_OK;
    }
    if (acc->dtype == FSDP_BF16 && g->dtype == FSDP_BF16 && KERNELS(acc)->axpy_bf16 && tensor_is_contiguous(acc)) {
        fsdp_tensor *gc;   /* bf16 natively: f32 math, one rounding per element */
        FSDP_TRY(tensor_contiguous(&gc, g));
        KERNELS(acc)->axpy_bf16(tensor_data(acc), tensor_data(gc), 1.0f, n);
        tensor_release(gc);
        return FSDP_OK;
    }
    /* Staged through f32 a chunk at a time: widening the whole of both (a bf16
     * embedding's gradient, say) would hold three copies of it at once. */
    fsdp_tensor *gc;
    FSDP_TRY(tensor_contiguous(&gc, g));
    fsdp_status st = FSDP_OK;
    const int64_t one = 1;
    for (int64_t at = 0; at < n && st == FSDP_OK; at += ADD_STAGE_ELEMS) {
        int64_t len = n - at < ADD_STAGE_ELEMS ? n - at : ADD_STAGE_ELEMS;
        fsdp_tensor *av = tensor_view(acc, 1, &len, &one, acc->offset + at);
        fsdp_tensor *gv = tensor_view(gc, 1, &len, &one, gc->offset + at);
        fsdp_tensor *a32 = NULL, *g32 = NULL;
        st = av && gv ? FSDP_OK : fsdp_set_error(FSDP_ERR_OOM, "backward: out of host memory for a view");
        if (st == FSDP_OK) st = tensor_as_f32(&a32, av);
        if (st == FSDP_OK) st = tensor_as_f32(&g32, gv);
        if (st == FSDP_OK) {
            KERNELS(a32)->axpy_f32(tensor_data(a32), tensor_data(g32), 1.0f, len);
            st = fsdp_copy(av, a32);
        }
        tensor_release(a32);
        tensor_release(g32);
        tensor_release(av);
        tensor_release(gv);
    }
    tensor_release(gc);
    return st;
}

/* A contiguous copy of g with t's dtype and the given tag. */
static fsdp_status fresh_grad(fsdp_tensor **out, fsdp_tensor *t, fsdp_tensor *g, int tag) {
    FSDP_TRY(tensor_new(out, t->dtype, t->ndim, t->shape, tensor_device(t), tag, false));
    fsdp_status st = fsdp_copy(*out, g);
    if (st != FSDP_OK) tensor_release(*out);
    return st;
}

fsdp_status tensor_accumulate_grad(fsdp_tensor *t, fsdp_tensor *g) {
    fsdp_status st = FSDP_OK;
    if (!t->requires_grad || !g) {
        tensor_release(g);
        return FSDP_OK;
    }
    if (g->ndim != t->ndim || memcmp(g->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim) != 0) {
        char a[200], b[200];
        st = fsdp_set_error(FSDP_ERR_SHAPE, "backward: gradient %s does not match tensor %s",
                            tensor_desc(g, a, sizeof a), tensor_desc(t, b, sizeof b));
        tensor_release(g);
        return st;
    }
    fsdp_tensor **slot = t->is_leaf ? &t->grad : &t->bgrad;
    if (!*slot) {
        /* A non-leaf's gradient is only read (by its node's backward), so it
         * may be g itself even when others hold g too (an add gives one
         * gradient to both inputs): no copy. Writing into it below copies
         * first when it is shared. A leaf's .grad is the user's: its own. */
        bool share = !t->is_leaf && g->dtype == t->dtype && tensor_is_contiguous(g);
        if (share) {
            *slot = g;
            return FSDP_OK;
        }
        st = fresh_grad(slot, t, g, t->is_leaf ? FSDP_TAG_GRAD : fsdp_default_tag());
    } else {
        bool shared = !t->is_leaf && (atomic_load(&(*slot)->refcount) > 1 ||
                                      atomic_load(&(*slot)->storage->refcount) > 1);
        if (shared) {   /* copy on write: the others keep the value they were given */
            fsdp_tensor *own;
            st = fresh_grad(&own, t, *slot, fsdp_default_tag());
            if (st == FSDP_OK) {
                tensor_release(*slot);
                *slot = own;
            }
        }
        if (st == FSDP_OK && (*slot)->unwritten) {   /* its first gradient: written, not added to garbage */
            st = fsdp_copy(*slot, g);
            if (st == FSDP_OK) (*slot)->unwritten = false;
        } else if (st == FSDP_OK) {
            st = add_into(*slot, g);
        }
    }
    tensor_release(g);
    return st;
}

fsdp_status node_add_grad(fsdp_node *node, int i, fsdp_tensor *g) {
    if (!node_needs_grad(node, i)) {
        tensor_release(g);
        return FSDP_OK;
    }
    return tensor_accumulate_grad(node->in[i], g);
}

fsdp_tensor *node_grad_peek(fsdp_node *node, int i, int dtype) {
    if (!node_needs_grad(node, i)) return NULL;
    fsdp_tensor *t = node->in[i], *g = t->grad;
    /* a leaf's .grad is its own (add_into writes it in place too); a
     * non-leaf's may be shared, so those go through node_add_grad */
    if (!t->is_leaf || !g || g->dtype != dtype || t->dtype != dtype || !tensor_is_contiguous(g)) return NULL;
    if (g->ndim != t->ndim || memcmp(g->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim) != 0) return NULL;
    if (tensor_device(g) != tensor_device(t)) return NULL;
    storage_written(g->storage);   /* the op writes into it */
    return g;
}

fsdp_tensor *node_grad_held(fsdp_node *node, int i, int dtype) {
    if (!node_needs_grad(node, i)) return NULL;
    fsdp_tensor *t = node->in[i], *g = t->bgrad;
    if (t->is_leaf || !g || g->unwritten || g->dtype != dtype || t->dtype != dtype || !tensor_is_contiguous(g))
        return NULL;
    if (g->ndim != t->ndim || memcmp(g->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim) != 0) return NULL;
    if (tensor_device(g) != tensor_device(t)) return NULL;
    /* shared (an add gave the same tensor to both inputs): the others keep
     * the value they were given, so it is added to by the tape after a copy */
    if (atomic_load(&g->refcount) > 1 || atomic_load(&g->storage->refcount) > 1) return NULL;
    return g;
}

fsdp_tensor *node_grad_accumulator(fsdp_node *node, int i, int dtype) {
    fsdp_tensor *g = node_grad_peek(node, i, dtype);
    if (g && g->unwritten) {   /* the op adds into it: zeros first */
        if (fsdp_fill(g, 0.0) != FSDP_OK) return NULL;   /* (then the op makes its own gradient) */
        g->unwritten = false;
    }
    return g;
}

void tape_note_value(fsdp_tensor *g, double v) {
    tape *tp = current_tape();
    if (!tp->in_backward || !g || tp->n_known == (int)(sizeof tp->known / sizeof tp->known[0])) return;
    tensor_retain(g);
    tp->known[tp->n_known].g = g;
    tp->known[tp->n_known].v = v;
    tp->known[tp->n_known].version = g->storage->version;
    tp->n_known++;
}

bool tape_known_value(const fsdp_tensor *g, double *v) {
    tape *tp = current_tape();
    for (int k = 0; g && k < tp->n_known; k++)
        if (tp->known[k].g == g) {
            if (g->storage->version != tp->known[k].version) return false;   /* written since */
            *v = tp->known[k].v;
            return true;
        }
    return false;
}

fsdp_tensor *node_grad_target(fsdp_node *node, int i, int dtype, float *beta) {
    fsdp_tensor *g = node_grad_peek(node, i, dtype);
    *beta = g && !g->unwritten ? 1.0f : 0.0f;
    if (g) g->unwritten = false;
    return g;
}

/* ---- public ---- */

fsdp_status fsdp_set_grad_enabled(int on, int *previous) {
    if (previous) *previous = grad_enabled;
    grad_enabled = on != 0;
    return FSDP_OK;
}

fsdp_status fsdp_grad_enabled(int *out) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_grad_enabled: out is NULL");
    *out = grad_enabled;
    return FSDP_OK;
}

fsdp_status fsdp_tensor_set_requires_grad(fsdp_tensor *t, int on) {
    if (!t) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_tensor_set_requires_grad: tensor is NULL");
    char d[200];
    if (on && !fsdp_dtype_is_float(t->dtype))
        return fsdp_set_error(FSDP_ERR_DTYPE, "fsdp_tensor_set_requires_grad: %s is not a float tensor",
                              tensor_desc(t, d, sizeof d));
    if (!t->is_leaf && !on)
        return fsdp_set_error(FSDP_ERR_STATE,
                              "fsdp_tensor_set_requires_grad: %s is the output of a recorded op; detach it instead",
                              tensor_desc(t, d, sizeof d));
    t->requires_grad = on != 0;
    return FSDP_OK;
}

fsdp_status fsdp_tensor_requires_grad(fsdp_tensor *t, int *out) {
    if (!t || !out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_tensor_requires_grad: NULL argument");
    *out = t->requires_grad;
    return FSDP_OK;
}

fsdp_status fsdp_tensor_grad(fsdp_tensor *t, fsdp_tensor **out) {
    if (!t || !out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_tensor_grad: NULL argument");
    *out = t->grad;
    tensor_retain(t->grad);
    return FSDP_OK;
}

fsdp_status fsdp_tensor_set_grad(fsdp_tensor *t, fsdp_tensor *grad) {
    if (!t) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_tensor_set_grad: tensor is NULL");
    char a[200], b[200];
    if (grad && (grad->ndim != t->ndim || memcmp(grad->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim)))
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_tensor_set_grad: gradient %s does not match tensor %s",
                              tensor_desc(grad, a, sizeof a), tensor_desc(t, b, sizeof b));
    if (grad && (grad->dtype != t->dtype || tensor_device(grad) != tensor_device(t)))
        return fsdp_set_error(FSDP_ERR_DTYPE, "fsdp_tensor_set_grad: gradient %s must have the dtype and device of %s",
                              tensor_desc(grad, a, sizeof a), tensor_desc(t, b, sizeof b));
    if (grad && !tensor_is_contiguous(grad))
        return fsdp_set_error(FSDP_ERR_LAYOUT, "fsdp_tensor_set_grad: gradient %s must be contiguous (gradients "
                              "accumulate in place)", tensor_desc(grad, a, sizeof a));
    tensor_retain(grad);
    tensor_release(t->grad);
    t->grad = grad;
    return FSDP_OK;
}

fsdp_status fsdp_tape_size(int64_t *out) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_tape_size: out is NULL");
    tape *tp = current_tape();
    *out = tp ? tp->n : 0;
    return FSDP_OK;
}

fsdp_status fsdp_tape_clear(void) {
    tape *tp = current_tape();
    if (tp) tape_reset(tp);
    return FSDP_OK;
}

fsdp_status fsdp_tape_push(void) {
    tape *tp = calloc(1, sizeof *tp);
    if (!tp) return fsdp_set_error(FSDP_ERR_OOM, "fsdp_tape_push: out of host memory");
    tp->below = current_tape();
    top = tp;
    return FSDP_OK;
}

fsdp_status fsdp_tape_pop(void) {
    tape *tp = current_tape();
    if (!tp || !tp->below) return fsdp_set_error(FSDP_ERR_STATE, "fsdp_tape_pop: no tape was pushed");
    tape_reset(tp);
    top = tp->below;
    free(tp->nodes);
    free(tp);
    return FSDP_OK;
}

/* Whether a node of tp made t (searched from the newest: a loss is
 * usually the last thing recorded). */
static bool on_tape(const tape *tp, const fsdp_tensor *t) {
    for (int64_t k = tp->n - 1; k >= 0; k--) {
        const fsdp_node *node = tp->nodes[k];
        if (!node) continue;
        for (int i = 0; i < node->n_out; i++)
            if (node->out[i] == t) return true;
    }
    return false;
}

fsdp_status fsdp_backward_begin(fsdp_tensor *root, fsdp_tensor *grad) {
    if (!root) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_backward: root is NULL");
    tape *tp = current_tape();
    char d[200], e[200];
    if (tp->in_backward) return fsdp_set_error(FSDP_ERR_STATE, "fsdp_backward: a backward is already in progress");
    if (!root->requires_grad)
        return fsdp_set_error(FSDP_ERR_STATE,
                              "fsdp_backward: %s does not require grad (no recorded op made it from a tensor "
                              "that requires grad, or gradients were disabled)",
                              tensor_desc(root, d, sizeof d));
    if (root->graph_freed && !on_tape(tp, root))
        return fsdp_set_error(FSDP_ERR_STATE,
                              "fsdp_backward: the graph that made %s was freed by an earlier backward (each "
                              "backward consumes its graph); run the forward again",
                              tensor_desc(root, d, sizeof d));
    fsdp_tensor *seed;
    if (!grad) {
        if (tensor_numel(root) != 1)
            return fsdp_set_error(FSDP_ERR_SHAPE,
                                  "fsdp_backward: %s is not a scalar; pass a gradient of its shape",
                                  tensor_desc(root, d, sizeof d));
        FSDP_TRY(tensor_new(&seed, root->dtype, root->ndim, root->shape, tensor_device(root), fsdp_default_tag(),
                            false));
        fsdp_fill(seed, 1.0);
    } else {
        if (grad->ndim != root->ndim || memcmp(grad->shape, root->shape, sizeof(int64_t) * (size_t)root->ndim))
            return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_backward: gradient %s does not match root %s",
                                  tensor_desc(grad, e, sizeof e), tensor_desc(root, d, sizeof d));
        FSDP_TRY(fresh_grad(&seed, root, grad, fsdp_default_tag()));
    }
    if (!grad) tensor_retain(seed);   /* (the tape's reference, below: accumulate takes one) */
    fsdp_status st = tensor_accumulate_grad(root, seed);
    if (st != FSDP_OK) {
        if (!grad) tensor_release(seed);
        return st;
    }
    tp->in_backward = true;
    tp->pos = tp->n - 1;
    tp->paused = NULL;
    if (!grad) {   /* the implicit gradient of a scalar root: one, known here */
        tape_note_value(seed, 1.0);
        tensor_release(seed);
    }
    return FSDP_OK;
}

static void finish_node(tape *tp, int64_t k) {
    fsdp_node *node = tp->nodes[k];
    drop_bgrads(node);
    node_free(node);
    tp->nodes[k] = NULL;
}

fsdp_status fsdp_backward_step(int *custom_id) {
    if (!custom_id) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_backward_step: custom_id is NULL");
    tape *tp = current_tape();
    if (!tp->in_backward) return fsdp_set_error(FSDP_ERR_STATE, "fsdp_backward_step: no backward in progress");
    if (tp->paused) {   /* the Lua backward of the paused node has run */
        grad_enabled = tp->grad_mode_before_pause;
        finish_node(tp, tp->pos);
        tp->paused = NULL;
        tp->pos--;
    }
    for (; tp->pos >= 0; tp->pos--) {
        fsdp_node *node = tp->nodes[tp->pos];
        if (node->marker) {
            bool was = grad_enabled;
            grad_enabled = false;
            fsdp_status st = node->marker(node->marker_ctx);
            grad_enabled = was;
            if (st != FSDP_OK) {
                char msg[4096];
                snprintf(msg, sizeof msg, "%s", fsdp_last_error());
                const char *op = node->op;   /* static text; the node goes with the reset */
                tape_reset(tp);
                return fsdp_set_error(st, "backward at %s: %s", op, msg);
            }
            finish_node(tp, tp->pos);
            continue;
        }
        bool flows = false;
        for (int i = 0; i < node->n_out; i++)
            if (node->out[i]->bgrad) flows = true;
        if (flows) {
            if (node->custom_id >= 0) {
                /* the Lua backward runs with gradients off, as C ones do;
                 * fsdp_backward_step restores the mode */
                tp->grad_mode_before_pause = grad_enabled;
                grad_enabled = false;
                tp->paused = node;
                *custom_id = node->custom_id;
                return FSDP_OK;
            }
            /* backward math is never itself recorded */
            bool was = grad_enabled;
            grad_enabled = false;
            op_device = node_device(node);
            double tt0 = trace_now();
            fsdp_status st = node->backward(node);
            if (tt0 > 0) {
                char name[48];
                snprintf(name, sizeof name, "%s backward", node->op);
                trace_event_add(TRACE_COMPUTE, name, trace_current_unit(), -1, -1, tt0, trace_now());
            }
            grad_enabled = was;
            if (st != FSDP_OK) {
                char msg[4096];
                snprintf(msg, sizeof msg, "%s", fsdp_last_error());
                const char *op = node->op;
                tape_reset(tp);
                return fsdp_set_error(st, "backward of %s: %s", op, msg);
            }
        }
        finish_node(tp, tp->pos);
    }
    fsdp_status st = run_finish_hooks(tp);
    tape_reset(tp);   /* every node was visited */
    *custom_id = -1;
    return st;
}

fsdp_status tape_record_marker(const char *op, fsdp_status (*fn)(void *ctx), void *ctx, void (*release)(void *ctx)) {
    fsdp_node *node = tape_record(op, NULL, 0, NULL, 0, NULL);
    if (!node) {
        if (release) release(ctx);
        return strstr(fsdp_last_error(), "during its backward") ? FSDP_ERR_STATE : FSDP_ERR_OOM;
    }
    node->marker = fn;
    node->marker_ctx = ctx;
    node->marker_release = release;
    return FSDP_OK;
}

fsdp_status tape_on_finish(fsdp_status (*fn)(void *ctx), void *ctx, void (*release)(void *ctx)) {
    tape *tp = current_tape();
    if (tp->n_finish == (int)(sizeof tp->finish / sizeof tp->finish[0])) {
        if (release) release(ctx);
        return fsdp_set_error(FSDP_ERR_STATE, "tape: too many end-of-backward hooks (%d)", tp->n_finish);
    }
    tp->finish[tp->n_finish].fn = fn;
    tp->finish[tp->n_finish].ctx = ctx;
    tp->finish[tp->n_finish].release = release;
    tp->n_finish++;
    return FSDP_OK;
}

fsdp_status fsdp_backward_abort(void) {
    tape *tp = current_tape();
    tape_reset(tp);
    return FSDP_OK;
}

fsdp_status fsdp_custom_record(int custom_id, int n_in, fsdp_tensor **inputs, int n_out, fsdp_tensor **outputs) {
    if (custom_id < 0) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_custom_record: negative id %d", custom_id);
    if (n_in < 0 || n_in > FSDP_NODE_MAX_IN || n_out < 1 || n_out > FSDP_NODE_MAX_OUT)
        return fsdp_set_error(FSDP_ERR_INVALID,
                              "fsdp_custom_record: %d inputs and %d outputs, expected at most %d and 1..%d", n_in,
                              n_out, FSDP_NODE_MAX_IN, FSDP_NODE_MAX_OUT);
    for (int i = 0; i < n_in; i++)
        if (!inputs[i]) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_custom_record: input %d is NULL", i);
    for (int i = 0; i < n_out; i++) {
        if (!outputs[i]) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_custom_record: output %d is NULL", i);
        if (!fsdp_dtype_is_float(outputs[i]->dtype)) {
            char d[200];
            return fsdp_set_error(FSDP_ERR_DTYPE, "fsdp_custom_record: output %d %s is not a float tensor", i,
                                  tensor_desc(outputs[i], d, sizeof d));
        }
    }
    fsdp_node *node = tape_record("custom", NULL, n_in, inputs, n_out, outputs);
    if (!node) return FSDP_ERR_OOM;
    node->custom_id = custom_id;
    return FSDP_OK;
}

static fsdp_status paused_node(const char *op, int i, bool input, fsdp_node **out) {
    tape *tp = current_tape();
    if (!tp->paused) return fsdp_set_error(FSDP_ERR_STATE, "%s: no custom op is waiting for its backward", op);
    int n = input ? tp->paused->n_in : tp->paused->n_out;
    if (i < 0 || i >= n)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: index %d out of range (the op has %d %s)", op, i, n,
                              input ? "inputs" : "outputs");
    *out = tp->paused;
    return FSDP_OK;
}

fsdp_status fsdp_custom_grad_output(int i, fsdp_tensor **out) {
    fsdp_node *node = NULL;
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_custom_grad_output: out is NULL");
    FSDP_TRY(paused_node("fsdp_custom_grad_output", i, false, &node));
    *out = node->out[i]->bgrad;
    tensor_retain(*out);
    return FSDP_OK;
}

fsdp_status fsdp_custom_add_grad_input(int i, fsdp_tensor *grad) {
    fsdp_node *node = NULL;
    if (!grad) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_custom_add_grad_input: grad is NULL");
    FSDP_TRY(paused_node("fsdp_custom_add_grad_input", i, true, &node));
    tensor_retain(grad);   /* the caller keeps its reference */
    return node_add_grad(node, i, grad);
}
