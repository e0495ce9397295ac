/* cuda_emu.cpp: the host emulation of CUDA described in cuda_emu.h. */
#include "cuda_emu.h"
#include "convert.h"
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <vector>

/* ---- failures: a bug in the code under test, reported and fatal ---- */

[[noreturn]] static void emu_fail(const char *what) {
    fprintf(stderr, "cuda_emu: %s\n", what);
    fflush(stderr);
    abort();
}

void emu_fail_kernel_ptrs(void) {
    emu_fail("a kernel with more pointer arguments than EMU_MAX_KERNEL_PTRS (the host guard could not open them)");
}

/* The compute thread launches kernels; the comm thread only touches memory,
 * streams and events: one lock for the allocation map and the streams. */
static std::mutex g_mu;
typedef std::lock_guard<std::mutex> emu_lock;

static cudaError_t g_last = cudaSuccess;
static long long g_launches;
static std::atomic<long long> g_late_runs;
static int g_device_count = -1;   /* -1: not read from the environment yet */
static thread_local int t_device;
static const int g_sm_count = 2;   /* small, so grid-stride loops go round */

static cudaError_t set_error(cudaError_t e, const char *why) {
    fprintf(stderr, "cuda_emu: %s\n", why);
    if (g_last == cudaSuccess) g_last = e;
    return e;
}

static int device_count(void) {
    if (g_device_count < 0) {
        const char *env = getenv("FSDP_EMU_GPUS");
        g_device_count = env && *env ? atoi(env) : 1;
    }
    return g_device_count;
}

extern "C" void emu_set_device_count(int n) { g_device_count = n; }
extern "C" int emu_device_count(void) { return device_count(); }
extern "C" long long emu_launch_count(void) { return g_launches; }
extern "C" long long emu_late_runs(void) { return g_late_runs; }

/* Allocation calls so far: cudaMalloc, cudaFree, cudaMallocAsync,
 * cudaFreeAsync, cudaHostAlloc (cudaMallocHost too), cudaFreeHost. */
static std::atomic<long long> g_memory_calls[6];
extern "C" void emu_memory_calls(long long out[6]) {
    for (int i = 0; i < 6; i++) out[i] = g_memory_calls[i];
}

/* ---- device memory: its own address range, guard pages, no reuse ---- */

static const size_t REGION = (size_t)1 << 36;   /* 64 GiB of address space, reserved only */
static char *g_region, *g_bump;
static size_t g_page;

struct emu_alloc {
    char *base;        /* first page */
    size_t pages;      /* accessible pages (a guard page follows) */
    size_t n;          /* bytes asked for */
    bool live;
    int open;          /* device ops using it now: readable and writable while > 0 */
};
static std::map<uintptr_t, emu_alloc> g_allocs;   /* by user pointer */

static void guard_install(void);

static void region_init(void) {
    if (g_region) return;
    g_page = (size_t)sysconf(_SC_PAGESIZE);
    void *r = mmap(NULL, REGION, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) emu_fail("cannot reserve the device address range");
    g_region = g_bump = (char *)r;
    guard_install();
}

static bool in_region(const void *p) {
    return g_region && (const char *)p >= g_region && (const char *)p < g_region + REGION;
}

/* The live allocation holding [p, p + n), or NULL. */
static const emu_alloc *find_alloc(const void *p, size_t n) {
    emu_lock lock(g_mu);
    auto it = g_allocs.upper_bound((uintptr_t)p);
    if (it == g_allocs.begin()) return NULL;
    --it;
    const emu_alloc &a = it->second;
    uintptr_t start = it->first, end = start + a.n;
    if ((uintptr_t)p < start || (uintptr_t)p + n > end || !a.live) return NULL;
    return &a;
}

void emu_check_device_ptr(const void *p, const char *what) {
    if (!p || in_region(p)) return;
    char buf[256];
    snprintf(buf, sizeof buf, "%s %p is not device memory (a host pointer given to the GPU?)", what, p);
    emu_fail(buf);
}

static void check_range(const void *p, size_t n, const char *what) {
    if (n == 0) return;
    if (!find_alloc(p, n)) {
        char buf[256];
        snprintf(buf, sizeof buf, "%s: [%p, +%zu) is not inside one live device allocation", what, p, n);
        emu_fail(buf);
    }
}

void emu_check_device_range(const void *p, size_t n, const char *what) { check_range(p, n, what); }

/* ---- the host guard ----
 * Live device memory is PROT_NONE except while a device op that was given
 * it runs: a kernel (its pointer arguments), a copy, a memset, a cuBLAS call
 * or an NCCL collective (their buffers). Each allocation counts the ops
 * using it and is readable while the count is above zero, so the compute
 * thread and the comm stream's thread can use memory at the same time
 * without one closing it under the other. Host code touching device memory
 * (a bug that would crash on a GPU, or read garbage through a bad pointer)
 * faults, and the SIGSEGV handler names the access, the allocation, the ops
 * running and the last op of the thread, and prints a backtrace.
 * What it cannot see: a host access to an allocation while a device op on
 * another thread happens to have that same allocation open. */

enum { EMU_OP_SLOTS = 64, EMU_OP_ALLOCS = EMU_MAX_KERNEL_PTRS };
struct emu_op_slot {
    std::atomic<bool> used;
    const char *kind, *name;
    pthread_t thread;
    int n;
    int outer;                       /* the op of this thread it runs inside (a call made of calls), or -1 */
    uintptr_t keys[EMU_OP_ALLOCS];   /* allocations opened (map keys) */
};
static emu_op_slot g_ops[EMU_OP_SLOTS];
static thread_local int t_op = -1;                                  /* the op this thread runs, or -1 */
static thread_local const char *t_last_kind = NULL, *t_last_name = NULL;   /* the last one it ran */
static std::atomic<long long> g_ops_run;

/* The allocation (live or freed) whose bytes hold p; g_mu held. */
static std::map<uintptr_t, emu_alloc>::iterator alloc_at(const void *p) {
    auto it = g_allocs.upper_bound((uintptr_t)p);
    if (it == g_allocs.begin()) return g_allocs.end();
    --it;
    size_t n = it->second.n ? it->second.n : 1;
    return (uintptr_t)p < it->first + n ? it : g_allocs.end();
}

static void set_open(emu_alloc &a, bool open) {
    if (mprotect(a.base, a.pages * g_page, open ? PROT_READ | PROT_WRITE : PROT_NONE) != 0)
        emu_fail("host guard: mprotect failed");
}

extern "C" int emu_op_begin(const char *kind, const char *name, const void *const *ptrs, int n) {
    emu_lock lock(g_mu);
    int slot = -1;
    for (int i = 0; i < EMU_OP_SLOTS && slot < 0; i++) {
        bool expect = false;
        if (g_ops[i].used.compare_exchange_strong(expect, true)) slot = i;
    }
    if (slot < 0) emu_fail("host guard: more than 64 device ops at once");
    emu_op_slot &o = g_ops[slot];
    o.kind = kind;
    o.name = name ? name : "?";
    o.thread = pthread_self();
    o.n = 0;
    for (int i = 0; i < n; i++) {
        if (!ptrs[i] || !in_region(ptrs[i])) continue;   /* host sides of copies */
        auto it = alloc_at(ptrs[i]);
        if (it == g_allocs.end() || !it->second.live) continue;   /* the op faults if it touches it */
        bool seen = false;
        for (int j = 0; j < o.n; j++) seen |= o.keys[j] == it->first;
        if (seen) continue;
        if (o.n == EMU_OP_ALLOCS) emu_fail("host guard: a device op with more buffers than EMU_OP_ALLOCS");
        o.keys[o.n++] = it->first;
        if (it->second.open++ == 0) set_open(it->second, true);
    }
    o.outer = t_op;
    t_op = slot;
    g_ops_run++;
    return slot;
}

extern "C" void emu_op_end(int slot) {
    emu_lock lock(g_mu);
    emu_op_slot &o = g_ops[slot];
    for (int j = 0; j < o.n; j++) {
        auto it = g_allocs.find(o.keys[j]);
        if (it == g_allocs.end()) continue;
        if (--it->second.open == 0 && it->second.live) set_open(it->second, false);
    }
    t_last_kind = o.kind;
    t_last_name = o.name;
    t_op = o.outer;
    o.used = false;
}

extern "C" long long emu_ops_run(void) { return g_ops_run; }

/* ---- the SIGSEGV handler (the process ends in it: it may allocate) ---- */

static struct sigaction g_old_segv;

static void say_ops(FILE *f, int mine) {
    int others = 0;
    for (int i = 0; i < EMU_OP_SLOTS; i++) {
        if (i == mine || !g_ops[i].used) continue;
        fprintf(f, "%s%s %s (on another thread)", others++ ? ", " : "  device ops running now: ", g_ops[i].kind,
                g_ops[i].name);
    }
    if (others) fprintf(f, "\n");
}

/* Frames from the faulting instruction (pc) on, as file:line where
 * addr2line can tell (the emulation is built with -g). */
static void say_backtrace(FILE *f, void *pc) {
    void *frames[48];
    int n = backtrace(frames, 48), first = 1;   /* 0: the handler */
    for (int i = 1; i < n; i++)
        if (frames[i] == pc) first = i;   /* the frames before it: the handler and the signal trampoline */
    char **names = backtrace_symbols(frames, n);
    fprintf(f, "  backtrace:\n");
    for (int i = first; i < n; i++) {
        char where[512] = "";
        Dl_info info;
        if (dladdr(frames[i], &info) && info.dli_fname && getenv("FSDP_EMU_NO_ADDR2LINE") == NULL) {
            char cmd[1024];
            /* a return address points after its call; the faulting pc at the access itself */
            uintptr_t off = (uintptr_t)frames[i] - (i == first && frames[i] == pc ? 0 : 1) - (uintptr_t)info.dli_fbase;
            snprintf(cmd, sizeof cmd, "addr2line -C -f -p -e '%s' 0x%lx 2>/dev/null", info.dli_fname,
                     (unsigned long)off);
            FILE *p = popen(cmd, "r");
            if (p) {
                if (!fgets(where, sizeof where, p)) where[0] = 0;
                pclose(p);
                where[strcspn(where, "\n")] = 0;
                if (strncmp(where, "??", 2) == 0) where[0] = 0;
            }
        }
        fprintf(f, "    #%-2d %s%s%s%s\n", i - first, names ? names[i] : "?", where[0] ? "  [" : "", where,
                where[0] ? "]" : "");
    }
}

static void on_segv(int sig, siginfo_t *si, void *uctx) {
    const void *addr = si->si_addr;
    if (!in_region(addr)) {   /* not ours: whoever handled SIGSEGV before */
        if (g_old_segv.sa_flags & SA_SIGINFO) {
            if (g_old_segv.sa_sigaction) return g_old_segv.sa_sigaction(sig, si, uctx);
        } else if (g_old_segv.sa_handler != SIG_DFL && g_old_segv.sa_handler != SIG_IGN) {
            return g_old_segv.sa_handler(sig);
        }
        signal(SIGSEGV, SIG_DFL);   /* returning re-runs the access, which now ends the process */
        return;
    }
    const char *rw = "an access";
#if defined(__x86_64__)
    rw = (((ucontext_t *)uctx)->uc_mcontext.gregs[REG_ERR] & 2) ? "a write" : "a read";
#endif
    char what[256] = "an address outside every allocation";
    auto it = g_allocs.upper_bound((uintptr_t)addr);
    if (it != g_allocs.begin()) {
        --it;
        const emu_alloc &a = it->second;
        uintptr_t start = it->first, p = (uintptr_t)addr;
        if (p < start + (a.n ? a.n : 1))
            snprintf(what, sizeof what, "byte %lu of %s allocation of %zu bytes at %p", (unsigned long)(p - start),
                     a.live ? "a live" : "a FREED", a.n, (void *)start);
        else if (p < (uintptr_t)a.base + (a.pages + 1) * g_page)
            snprintf(what, sizeof what, "%lu bytes past the end of %s allocation of %zu bytes at %p",
                     (unsigned long)(p - start - a.n), a.live ? "the live" : "the freed", a.n, (void *)start);
    }
    FILE *f = stderr;
    int mine = t_op;
    if (mine < 0) {
        fprintf(f,
                "cuda_emu: host guard: %s of device memory at %p (%s) by host code, outside every device op.\n"
                "  Device memory is touched only by kernels, copies, memsets, cuBLAS and NCCL on a GPU: copy it to "
                "the host first (copy_to_host), or pass the pointer to a kernel.\n"
                "  last device op of this thread: %s %s (ended)\n",
                rw, addr, what, t_last_kind ? t_last_kind : "none", t_last_name ? t_last_name : "");
    } else {
        const emu_op_slot &o = g_ops[mine];
        fprintf(f, "cuda_emu: device op %s %s (running) made %s of %p: %s%s\n", o.kind, o.name, rw, addr, what,
                strstr(what, "live allocation") ? " that the op was not given (only its pointer arguments and "
                                                  "buffers are open to it)"
                                                : "");
    }
    say_ops(f, mine);
    void *pc = NULL;
#if defined(__x86_64__)
    pc = (void *)((ucontext_t *)uctx)->uc_mcontext.gregs[REG_RIP];
#endif
    say_backtrace(f, pc);
    fflush(f);
    signal(SIGSEGV, SIG_DFL);
}

/* ---- the SIGILL handler: a trapped alignment check ----
 * The engine's .cu sources are built for the emulation with
 * -fsanitize=alignment in trap mode (tests/gpu/CMakeLists.txt): an access
 * through a pointer that is not a multiple of its type's alignment (a
 * 16-byte vector at an odd element offset, a double at a 4-byte boundary)
 * executes a trap instruction here, where a GPU would stop the kernel with
 * "misaligned address". x86 itself runs such accesses, so without the check
 * the emulation would pass code a GPU cannot run. */
static void on_sigill(int, siginfo_t *, void *uctx) {
    FILE *f = stderr;
    int mine = t_op;
    void *pc = NULL;
#if defined(__x86_64__)
    pc = (void *)((ucontext_t *)uctx)->uc_mcontext.gregs[REG_RIP];
#else
    (void)uctx;
#endif
    if (mine >= 0)
        fprintf(f, "cuda_emu: device op %s %s (running) trapped at %p: a misaligned access (an address not a multiple "
                   "of its type's alignment; a GPU stops the kernel with \"misaligned address\")\n",
                g_ops[mine].kind, g_ops[mine].name, pc);
    else
        fprintf(f, "cuda_emu: a trap at %p outside every device op (a misaligned access in host code built with the "
                   "alignment check, or an explicit trap)\n", pc);
    say_ops(f, mine);
    say_backtrace(f, pc);
    fflush(f);
    signal(SIGABRT, SIG_DFL);
    abort();
}

static void guard_install(void) {
    void *warm[2];
    backtrace(warm, 2);   /* loads the unwinder now, not inside the handler */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sa.sa_sigaction = on_sigill;
    sigaction(SIGILL, &sa, NULL);
}

/* Opens its buffers for the lifetime of a scope (C++ callers). */
struct emu_op_scope {
    int slot;
    emu_op_scope(const char *kind, const char *name, std::initializer_list<const void *> ptrs)
        : slot(emu_op_begin(kind, name, ptrs.begin(), (int)ptrs.size())) {}
    ~emu_op_scope() { emu_op_end(slot); }
};

/* ---- streams and events ---- */

struct emu_stream_s {
    bool late;                                  /* the comm stream: its own thread runs its work, late */
    std::mutex mu;
    std::condition_variable cv;                 /* work arrived, or work ran */
    std::deque<std::function<void()>> pending;  /* late work not run yet */
    long long enqueued = 0, ran = 0;            /* work items so far */
};
struct emu_event_s {
    emu_stream_s *stream;   /* where it was last recorded, or NULL */
    long long at;           /* complete once the stream ran this many items */
};

/* A late stream's thread: each item runs a little after it was enqueued,
 * in order, so that readers who did not wait see the old memory. */
static void late_worker(emu_stream_s *s) {
    std::unique_lock<std::mutex> lock(s->mu);
    for (;;) {
        s->cv.wait(lock, [s] { return !s->pending.empty(); });
        std::function<void()> f = std::move(s->pending.front());
        s->pending.pop_front();
        lock.unlock();
        usleep(200);
        f();
        lock.lock();
        s->ran++;
        g_late_runs++;
        s->cv.notify_all();
    }
}

/* Blocks until s ran `upto` items (all it was given for -1). */
static void wait_for(emu_stream_s *s, long long upto) {
    if (!s || !s->late) return;
    std::unique_lock<std::mutex> lock(s->mu);
    long long target = upto < 0 ? s->enqueued : upto;
    s->cv.wait(lock, [s, target] { return s->ran >= target; });
}

static std::mutex g_streams_mu;
static std::vector<emu_stream_s *> g_streams;

static void wait_all_streams(void) {
    std::vector<emu_stream_s *> all;
    {
        std::lock_guard<std::mutex> lock(g_streams_mu);
        all = g_streams;
    }
    for (emu_stream_s *s : all) wait_for(s, -1);
}

static void enqueue(emu_stream_s *s, std::function<void()> f) {
    if (s && s->late) {
        std::lock_guard<std::mutex> lock(s->mu);
        s->pending.push_back(std::move(f));
        s->enqueued++;
        s->cv.notify_all();
        return;
    }
    f();
}

extern "C" cudaError_t emu_stream_enqueue(cudaStream_t s, void (*fn)(void *), void *arg) {
    enqueue(s, [fn, arg]() { fn(arg); });
    return cudaSuccess;
}

static cudaError_t new_stream(cudaStream_t *s, bool late) {
    if (!s) return cudaErrorInvalidValue;
    emu_stream_s *st = new emu_stream_s;
    st->late = late;
    if (late) std::thread(late_worker, st).detach();   /* lives as long as the process, as the stream does */
    std::lock_guard<std::mutex> lock(g_streams_mu);
    g_streams.push_back(st);
    *s = st;
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) { return new_stream(s, false); }
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned, int) { return new_stream(s, true); }
cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
    *least = 0;
    *greatest = -5;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    wait_for(s, -1);
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned) {
    if (!e) return cudaErrorInvalidValue;
    *e = new emu_event_s{NULL, 0};
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    if (!e) return set_error(cudaErrorInvalidResourceHandle, "cudaEventRecord of a NULL event");
    e->stream = s && s->late ? s : NULL;   /* on the compute stream: complete at once */
    if (e->stream) {
        std::lock_guard<std::mutex> lock(s->mu);
        e->at = s->enqueued;
    }
    return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
    if (!e) return set_error(cudaErrorInvalidResourceHandle, "cudaEventQuery of a NULL event");
    if (!e->stream) return cudaSuccess;
    std::lock_guard<std::mutex> lock(e->stream->mu);
    return e->stream->ran >= e->at ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    if (!e) return set_error(cudaErrorInvalidResourceHandle, "cudaEventSynchronize of a NULL event");
    wait_for(e->stream, e->at);
    return cudaSuccess;
}
/* The waiting stream's later work runs after the event; the compute stream
 * runs its work at once in the calling thread, so the caller waits here. */
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
    if (!e) return set_error(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent on a NULL event");
    if (s && s->late) {   /* a late stream waits in its own order */
        cudaEvent_t copy = new emu_event_s(*e);
        enqueue(s, [copy]() {
            wait_for(copy->stream, copy->at);
            delete copy;
        });
        return cudaSuccess;
    }
    wait_for(e->stream, e->at);
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;   /* (CUDA lets pending events be destroyed; streams do not refer to them) */
    return cudaSuccess;
}

/* ---- memory calls ---- */

static cudaError_t device_alloc(void **p, size_t n) {
    emu_lock lock(g_mu);
    region_init();
    if (!p) return cudaErrorInvalidValue;
    size_t user = (n + 15) & ~(size_t)15;
    size_t pages = (user + g_page - 1) / g_page;
    if (pages == 0) pages = 1;
    if ((size_t)(g_bump - g_region) + (pages + 1) * g_page > REGION) return cudaErrorMemoryAllocation;
    char *base = g_bump;
    g_bump += (pages + 1) * g_page;
    if (mprotect(base, pages * g_page, PROT_READ | PROT_WRITE) != 0) return cudaErrorMemoryAllocation;
    char *ptr = base + pages * g_page - user;   /* flush against the guard page */
    memset(ptr, 0xff, user);                    /* NaN floats: unwritten memory shows */
    mprotect(base, pages * g_page, PROT_NONE);  /* the host guard: only device ops open it */
    g_allocs[(uintptr_t)ptr] = emu_alloc{base, pages, n, true, 0};
    *p = ptr;
    return cudaSuccess;
}

static cudaError_t free_now(void *p) {
    if (!p) return cudaSuccess;
    emu_lock lock(g_mu);
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end() || !it->second.live) return set_error(cudaErrorInvalidValue, "cudaFree of a pointer it did not allocate");
    it->second.live = false;
    madvise(it->second.base, it->second.pages * g_page, MADV_DONTNEED);
    mprotect(it->second.base, it->second.pages * g_page, PROT_NONE);   /* use after free faults */
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t n) {
    g_memory_calls[0]++;
    return device_alloc(p, n);
}

/* cudaFree waits for the whole device, as CUDA's does. */
cudaError_t cudaFree(void *p) {
    g_memory_calls[1]++;
    if (!p) return cudaSuccess;
    wait_all_streams();
    return free_now(p);
}

cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t) {
    g_memory_calls[2]++;
    return device_alloc(p, n);
}
/* Ordered after the compute stream's work only (which has run): a comm
 * stream item still using the memory faults when it runs. */
cudaError_t cudaFreeAsync(void *p, cudaStream_t s) {
    g_memory_calls[3]++;
    if (s && s->late) return set_error(cudaErrorInvalidValue, "cudaFreeAsync on the comm stream is not emulated");
    return free_now(p);
}

cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) {
    check_range(p, n, "cudaMemsetAsync");
    enqueue(s, [=]() {
        check_range(p, n, "cudaMemsetAsync (when it ran)");
        emu_op_scope op("cudaMemsetAsync", "", {p});
        memset(p, v, n);
    });
    return cudaSuccess;
}

/* ---- pinned host memory ----
 * Page-locked host memory (cudaHostAlloc, cudaMallocHost) is ordinary host
 * memory that host code reads and writes, as on a GPU; what changes is the
 * copies: from or to pinned memory cudaMemcpyAsync is truly asynchronous
 * (the stream reads or writes the host bytes when it runs, so the host must
 * not touch them before an event says the copy is done), while from or to
 * pageable memory it is not: a copy to the device stages the source before
 * it returns, a copy to the host returns once the bytes have arrived.
 * cudaFreeHost waits for every stream (as CUDA's does) and unmaps the
 * block, so a late use of freed pinned memory faults. */
struct emu_pinned {
    size_t len;   /* mapped bytes */
};
static std::map<uintptr_t, emu_pinned> g_pinned;   /* by pointer; g_mu */

/* Whether [p, p + n) lies inside one pinned block. */
static bool is_pinned(const void *p, size_t n) {
    emu_lock lock(g_mu);
    auto it = g_pinned.upper_bound((uintptr_t)p);
    if (it == g_pinned.begin()) return false;
    --it;
    return (uintptr_t)p >= it->first && (uintptr_t)p + n <= it->first + it->second.len;
}

cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags) {
    g_memory_calls[4]++;
    if (!p) return set_error(cudaErrorInvalidValue, "cudaHostAlloc: p is NULL");
    *p = NULL;
    if (flags & ~(unsigned)(cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined))
        return set_error(cudaErrorInvalidValue, "cudaHostAlloc: unknown flags");
    size_t len = n ? n : 1;
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return set_error(cudaErrorMemoryAllocation, "cudaHostAlloc: out of host memory");
    emu_lock lock(g_mu);
    g_pinned[(uintptr_t)m] = emu_pinned{len};
    *p = m;
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t n) { return cudaHostAlloc(p, n, cudaHostAllocDefault); }

cudaError_t cudaFreeHost(void *p) {
    g_memory_calls[5]++;
    if (!p) return cudaSuccess;
    wait_all_streams();
    emu_lock lock(g_mu);
    auto it = g_pinned.find((uintptr_t)p);
    if (it == g_pinned.end()) return set_error(cudaErrorInvalidValue, "cudaFreeHost of a pointer cudaHostAlloc did not return");
    munmap(p, it->second.len);
    g_pinned.erase(it);
    return cudaSuccess;
}

extern "C" int emu_is_pinned(const void *p, size_t n) { return is_pinned(p, n) ? 1 : 0; }

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t s) {
    if (n == 0) return cudaSuccess;
    bool dd = kind == cudaMemcpyDeviceToDevice || kind == cudaMemcpyHostToDevice;
    bool sd = kind == cudaMemcpyDeviceToDevice || kind == cudaMemcpyDeviceToHost;
    if (kind == cudaMemcpyHostToHost || kind == cudaMemcpyDefault)
        return set_error(cudaErrorInvalidValue, "cudaMemcpyAsync: the backend names its copy directions");
    if (dd) check_range(dst, n, "cudaMemcpyAsync destination");
    else if (in_region(dst)) emu_fail("cudaMemcpyAsync: a device destination for a copy to the host");
    if (sd) check_range(src, n, "cudaMemcpyAsync source");
    else if (in_region(src)) emu_fail("cudaMemcpyAsync: a device source for a copy from the host");
    const char *what = dd && sd ? "device to device" : dd ? "host to device" : "device to host";
    bool late = s && s->late;   /* (the compute stream runs a copy at once: nothing to stage or wait for) */
    if (late && kind == cudaMemcpyHostToDevice && !is_pinned(src, n)) {
        /* pageable: staged now, so the caller may reuse src at once */
        std::shared_ptr<std::vector<char>> staged = std::make_shared<std::vector<char>>((const char *)src,
                                                                                        (const char *)src + n);
        enqueue(s, [=]() {
            check_range(dst, n, "cudaMemcpyAsync destination (when it ran)");
            emu_op_scope op("cudaMemcpyAsync", what, {dst});
            memcpy(dst, staged->data(), n);
        });
        return cudaSuccess;
    }
    enqueue(s, [=]() {
        if (dd) check_range(dst, n, "cudaMemcpyAsync destination (when it ran)");
        if (sd) check_range(src, n, "cudaMemcpyAsync source (when it ran)");
        emu_op_scope op("cudaMemcpyAsync", what, {dst, src});
        memmove(dst, src, n);
    });
    /* pageable destination: the call returns once the bytes are there */
    if (late && kind == cudaMemcpyDeviceToHost && !is_pinned(dst, n)) wait_for(s, -1);
    return cudaSuccess;
}

/* ---- devices and attributes ---- */

static struct emu_pool_s { int dummy; } g_pool_obj;
static struct emu_cublas_s { int dummy; } g_cublas_obj;
static std::map<const void *, int> g_smem_allowed;

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected (emulated)";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    }
    return "unknown error";
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = g_last;
    g_last = cudaSuccess;
    return e;
}

cudaError_t cudaGetDeviceCount(int *n) {
    *n = 0;
    if (device_count() <= 0) return cudaErrorNoDevice;
    *n = device_count();
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) {
    if (d < 0 || d >= device_count()) return cudaErrorInvalidDevice;
    t_device = d;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int *d) {
    *d = t_device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d) {
    if (d < 0 || d >= device_count()) return cudaErrorInvalidDevice;
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "CUDA emulation on the host");
    p->multiProcessorCount = g_sm_count;
    p->totalGlobalMem = (size_t)1 << 34;
    return cudaSuccess;
}

/* A block's opt-in dynamic shared memory: an H100's or H200's 227 KiB, or
 * FSDP_EMU_SMEM_OPTIN bytes (e.g. 101376, the 99 KiB of sm_86 and sm_89) */
static int emu_smem_optin(void) {
    const char *s = getenv("FSDP_EMU_SMEM_OPTIN");
    return s && *s ? atoi(s) : 227 * 1024;
}

cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int) {
    *v = a == cudaDevAttrMemoryPoolsSupported ? 1 : 0;
    if (a == cudaDevAttrMaxSharedMemoryPerBlockOptin) *v = emu_smem_optin();
    return cudaSuccess;
}
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *p, int) {
    *p = &g_pool_obj;
    return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void *) { return cudaSuccess; }

cudaError_t cudaFuncSetAttribute(const void *fn, cudaFuncAttribute a, int v) {
    if (a != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
    if (v < 0 || v > emu_smem_optin())
        return set_error(cudaErrorInvalidValue, "dynamic shared memory above the device's opt-in limit");
    g_smem_allowed[fn] = v;
    return cudaSuccess;
}

/* ---- fibers ---- */

/* Switching fibers: on x86-64 a few instructions that swap the stack and the
 * callee-saved registers (swapcontext also saves the signal mask, a system
 * call per switch, which made kernels 10x slower); ucontext elsewhere. */
#if defined(__x86_64__)
#define EMU_FAST_SWITCH 1
extern "C" void emu_ctx_switch(void **save_sp, void *load_sp);
__asm__(".text\n"
        ".globl emu_ctx_switch\n"
        ".hidden emu_ctx_switch\n"
        ".type emu_ctx_switch,@function\n"
        "emu_ctx_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size emu_ctx_switch,.-emu_ctx_switch\n");
#endif

enum { F_READY, F_BLOCK_WAIT, F_WARP_WAIT, F_DONE };
struct emu_fiber {
#ifdef EMU_FAST_SWITCH
    void *sp;
#else
    ucontext_t ctx;
#endif
    char *stack;
    int state;
    uint3 idx;
    const char *collective;   /* the warp-collective call it waits at (F_WARP_WAIT) */
};
static const size_t STACK = 256 * 1024;
static std::vector<emu_fiber> g_fibers;
#ifdef EMU_FAST_SWITCH
static void *g_sched_sp;
#else
static ucontext_t g_sched;
#endif
static int g_cur = -1;            /* the running fiber, -1 outside kernels */
static unsigned g_nt;             /* threads of the running block */
static dim3 g_block_dim, g_grid_dim;
static uint3 g_block_idx;
static const std::function<void()> *g_body;
static std::vector<char> g_smem;
static unsigned char g_xslot[1024][16];

/* from the running fiber to the scheduler, and back */
static void to_scheduler(emu_fiber &f) {
#ifdef EMU_FAST_SWITCH
    emu_ctx_switch(&f.sp, g_sched_sp);
#else
    swapcontext(&f.ctx, &g_sched);
#endif
}
static void to_fiber(emu_fiber &f) {
#ifdef EMU_FAST_SWITCH
    emu_ctx_switch(&g_sched_sp, f.sp);
#else
    swapcontext(&g_sched, &f.ctx);
#endif
}

static void fiber_main(void) {
    (*g_body)();
    g_fibers[g_cur].state = F_DONE;
#ifdef EMU_FAST_SWITCH
    to_scheduler(g_fibers[g_cur]);   /* never resumed */
    abort();
#endif
}   /* (ucontext: returns to g_sched through uc_link) */

/* A fresh fiber that starts in fiber_main at its first switch. */
static void fiber_reset(emu_fiber &f) {
#ifdef EMU_FAST_SWITCH
    uintptr_t top = ((uintptr_t)f.stack + STACK) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = NULL;                      /* fiber_main's return address slot: never used */
    *--sp = (void *)fiber_main;        /* where emu_ctx_switch's ret goes */
    for (int i = 0; i < 6; i++) *--sp = NULL;   /* rbp rbx r12-r15 */
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = STACK;
    f.ctx.uc_link = &g_sched;
    makecontext(&f.ctx, fiber_main, 0);
#endif
}

static void need_kernel(const char *what) {
    if (g_cur < 0) {
        char buf[128];
        snprintf(buf, sizeof buf, "%s outside a kernel", what);
        emu_fail(buf);
    }
}

uint3 emu_thread_idx(void) {
    need_kernel("threadIdx");
    return g_fibers[g_cur].idx;
}
uint3 emu_block_idx(void) { return g_block_idx; }
dim3 emu_block_dim(void) { return g_block_dim; }
dim3 emu_grid_dim(void) { return g_grid_dim; }
/* 128-byte aligned, as a GPU's shared memory window (wmma needs 32) */
void *emu_dyn_smem(void) { return (void *)(((uintptr_t)g_smem.data() + 127) & ~(uintptr_t)127); }

static void wait_at(int kind, const char *collective = NULL) {
    emu_fiber &f = g_fibers[g_cur];
    f.state = kind;
    f.collective = collective;
    to_scheduler(f);
}

int emu_lane(void) {
    need_kernel("a lane index");
    return g_cur & 31;
}

void emu_warp_collective(const char *what) {
    need_kernel(what);
    int lane = g_cur & 31, base = g_cur - lane;
    if ((unsigned)base + 32 > g_nt) {
        char buf[160];
        snprintf(buf, sizeof buf, "%s in a partial warp (threads per block not a multiple of 32)", what);
        emu_fail(buf);
    }
    wait_at(F_WARP_WAIT, what);
}

void __syncthreads(void) {
    need_kernel("__syncthreads");
    wait_at(F_BLOCK_WAIT);
}

void __syncwarp(unsigned mask) {
    need_kernel("__syncwarp");
    if (mask != 0xffffffffu) emu_fail("__syncwarp with a partial mask is not emulated");
    wait_at(F_WARP_WAIT, "__syncwarp");
}

void emu_shuffle(const void *mine, void *out, size_t size, int mode, int arg, unsigned mask) {
    need_kernel("a shuffle");
    if (mask != 0xffffffffu) emu_fail("shuffles with a partial mask are not emulated");
    int t = g_cur, lane = t & 31, base = t - lane;
    if ((unsigned)base + 32 > g_nt) emu_fail("a shuffle in a partial warp (threads per block not a multiple of 32)");
    if (size > sizeof g_xslot[0]) emu_fail("a shuffle of more than 16 bytes");
    memcpy(g_xslot[t], mine, size);
    wait_at(F_WARP_WAIT, "a shuffle");
    int src = mode == EMU_SHFL_XOR ? (lane ^ arg) & 31 : mode == EMU_SHFL_DOWN ? (lane + arg > 31 ? lane : lane + arg)
                                                                               : arg & 31;
    memcpy(out, g_xslot[base + src], size);
    wait_at(F_WARP_WAIT, "a shuffle");
}

/* FSDP_EMU_ORDER=reverse: the blocks of a grid, and the threads of a block
 * between two barriers, run last to first. A GPU promises neither order, so
 * a correct kernel computes the same either way; one that reads what
 * another thread (or block) writes without a barrier between them sees the
 * value in one order and not in the other (gpu.test_cuda_kernels_emu.reverse). */
static bool emu_reverse_order(void) {
    static int r = -1;
    if (r < 0) {
        const char *v = getenv("FSDP_EMU_ORDER");
        if (v && *v && strcmp(v, "reverse") != 0 && strcmp(v, "forward") != 0)
            emu_fail("FSDP_EMU_ORDER must be forward (the default) or reverse");
        r = v && strcmp(v, "reverse") == 0;
    }
    return r == 1;
}

static void run_block(void) {
    unsigned n = g_nt;
    const bool reverse = emu_reverse_order();
    if (g_fibers.size() < n) g_fibers.resize(n);
    for (unsigned t = 0; t < n; t++) {
        emu_fiber &f = g_fibers[t];
        if (!f.stack) {
            /* a guard page under each stack: an overflow faults instead of corrupting the heap */
            size_t page = (size_t)sysconf(_SC_PAGESIZE);
            void *m = mmap(NULL, STACK + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED) emu_fail("out of memory for fiber stacks");
            mprotect(m, page, PROT_NONE);
            f.stack = (char *)m + page;
        }
        fiber_reset(f);
        f.state = F_READY;
        f.idx = uint3{t % g_block_dim.x, (t / g_block_dim.x) % g_block_dim.y, t / (g_block_dim.x * g_block_dim.y)};
    }
    for (;;) {
        for (unsigned k = 0; k < n; k++) {
            unsigned t = reverse ? n - 1 - k : k;
            if (g_fibers[t].state == F_READY) {
                g_cur = (int)t;
                to_fiber(g_fibers[t]);
                g_cur = -1;
            }
        }
        unsigned done = 0, at_block = 0;
        for (unsigned t = 0; t < n; t++) {
            done += g_fibers[t].state == F_DONE;
            at_block += g_fibers[t].state == F_BLOCK_WAIT;
        }
        if (done == n) return;
        if (at_block > 0 && at_block + done == n) {
            if (done > 0) emu_fail("__syncthreads: some threads of the block exited while others wait at it");
            for (unsigned t = 0; t < n; t++) g_fibers[t].state = F_READY;
            continue;
        }
        bool released = false;
        for (unsigned w = 0; w * 32 < n; w++) {
            unsigned lo = w * 32, hi = lo + 32 < n ? lo + 32 : n, waiting = 0, wdone = 0;
            for (unsigned t = lo; t < hi; t++) {
                waiting += g_fibers[t].state == F_WARP_WAIT;
                wdone += g_fibers[t].state == F_DONE;
            }
            if (waiting == 0 || waiting + wdone < hi - lo) continue;
            if (wdone > 0) emu_fail("a warp barrier or shuffle: some lanes exited while others wait");
            for (unsigned t = lo + 1; t < hi; t++) {
                const char *a = g_fibers[lo].collective, *b = g_fibers[t].collective;
                if (a != b && (!a || !b || strcmp(a, b) != 0)) {
                    char buf[256];
                    snprintf(buf, sizeof buf,
                             "the lanes of a warp are at different warp-collective calls: lane 0 at %s, lane %u at %s "
                             "(every lane of the warp must make the same call)",
                             a ? a : "?", t - lo, b ? b : "?");
                    emu_fail(buf);
                }
            }
            for (unsigned t = lo; t < hi; t++) g_fibers[t].state = F_READY;
            released = true;
        }
        if (!released)
            emu_fail("deadlock: the threads of a block wait at different barriers (__syncthreads in divergent code, "
                     "or a shuffle not reached by the whole warp)");
    }
}

void emu_run(const emu_launch_cfg &c, const std::function<void()> &body) {
    g_launches++;
    unsigned long long nt = (unsigned long long)c.block.x * c.block.y * c.block.z;
    if (nt == 0 || nt > 1024 || c.block.x > 1024 || c.block.y > 1024 || c.block.z > 64) {
        set_error(cudaErrorInvalidConfiguration, "launch: bad block size");
        return;
    }
    if (c.grid.x == 0 || c.grid.y == 0 || c.grid.z == 0 || c.grid.x > 2147483647u || c.grid.y > 65535 ||
        c.grid.z > 65535) {
        set_error(cudaErrorInvalidConfiguration, "launch: bad grid size");
        return;
    }
    if (c.smem > 48 * 1024) {
        auto it = g_smem_allowed.find(c.fn);
        if (it == g_smem_allowed.end() || (size_t)it->second < c.smem) {
            set_error(cudaErrorInvalidValue, "launch: dynamic shared memory above 48 KiB without cudaFuncSetAttribute");
            return;
        }
    }
    if (g_cur >= 0) emu_fail("a launch from inside a kernel");
    g_smem.assign(c.smem + 128, (char)0xff);
    g_block_dim = c.block;
    g_grid_dim = c.grid;
    g_nt = (unsigned)nt;
    g_body = &body;
    const bool reverse = emu_reverse_order();
    for (unsigned z = 0; z < c.grid.z; z++)
        for (unsigned y = 0; y < c.grid.y; y++)
            for (unsigned x = 0; x < c.grid.x; x++) {
                g_block_idx = reverse ? uint3{c.grid.x - 1 - x, c.grid.y - 1 - y, c.grid.z - 1 - z} : uint3{x, y, z};
                run_block();
            }
    g_body = NULL;
}

/* ---- cuBLAS: column-major, double accumulation ---- */

cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = &g_cublas_obj;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t) {
    return h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t) {
    return h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
const char *cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

/* One element of a cuBLAS operand as double. */
static double emu_elem(const void *p, cudaDataType_t t, size_t i) {
    if (t == CUDA_R_16BF) return (double)bf16_to_f32(((const uint16_t *)p)[i]);
    return (double)((const float *)p)[i];
}
static void emu_store(void *p, cudaDataType_t t, size_t i, double v) {
    if (t == CUDA_R_16BF) ((uint16_t *)p)[i] = f32_to_bf16((float)v);   /* one rounding, to nearest even */
    else ((float *)p)[i] = (float)v;
}

/* column-major C = alpha op(A) op(B) + beta C, accumulated in double */
static cublasStatus_t emu_gemm(const char *name, cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                               float alpha, const void *A, cudaDataType_t at, int lda, long long sa, const void *B,
                               cudaDataType_t bt, int ldb, long long sb, float beta, void *C, cudaDataType_t ct,
                               int ldc, long long sc, int batch) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    int rows_a = ta == CUBLAS_OP_N ? m : k, rows_b = tb == CUBLAS_OP_N ? k : n;
    if (m < 0 || n < 0 || k < 0 || batch < 0 || lda < (rows_a > 1 ? rows_a : 1) || ldb < (rows_b > 1 ? rows_b : 1) ||
        ldc < (m > 1 ? m : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    emu_check_device_ptr(A, "cublas A");
    emu_check_device_ptr(B, "cublas B");
    emu_check_device_ptr(C, "cublas C");
    emu_op_scope op("cuBLAS", name, {A, B, C});
    for (int b = 0; b < batch; b++)
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                double acc = 0.0;
                for (int l = 0; l < k; l++) {
                    double x = emu_elem(A, at, b * sa + (ta == CUBLAS_OP_N ? i + (size_t)l * lda : l + (size_t)i * lda));
                    double y = emu_elem(B, bt, b * sb + (tb == CUBLAS_OP_N ? l + (size_t)j * ldb : j + (size_t)l * ldb));
                    acc += x * y;
                }
                size_t at_c = b * sc + i + (size_t)j * ldc;
                double v = beta == 0.0f ? alpha * acc : alpha * acc + (double)beta * emu_elem(C, ct, at_c);
                emu_store(C, ct, at_c, v);
            }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                         int k, const float *alpha, const float *A, int lda, long long sa,
                                         const float *B, int ldb, long long sb, const float *beta, float *C, int ldc,
                                         long long sc, int batch) {
    return emu_gemm("cublasSgemmStridedBatched", h, ta, tb, m, n, k, *alpha, A, CUDA_R_32F, lda, sa, B, CUDA_R_32F, ldb, sb, *beta, C, CUDA_R_32F,
                    ldc, sc, batch);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                          int k, const void *alpha, const void *A, cudaDataType_t at, int lda,
                                          long long sa, const void *B, cudaDataType_t bt, int ldb, long long sb,
                                          const void *beta, void *C, cudaDataType_t ct, int ldc, long long sc,
                                          int batch, cublasComputeType_t compute, cublasGemmAlgo_t) {
    if (compute != CUBLAS_COMPUTE_32F) return CUBLAS_STATUS_INVALID_VALUE;   /* alpha, beta are floats then */
    return emu_gemm("cublasGemmStridedBatchedEx", h, ta, tb, m, n, k, *(const float *)alpha, A, at, lda, sa, B, bt, ldb, sb, *(const float *)beta,
                    C, ct, ldc, sc, batch);
}

cublasStatus_t cublasGemmBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   const void *alpha, const void *const Aarray[], cudaDataType_t at, int lda,
                                   const void *const Barray[], cudaDataType_t bt, int ldb, const void *beta,
                                   void *const Carray[], cudaDataType_t ct, int ldc, int batch,
                                   cublasComputeType_t compute, cublasGemmAlgo_t) {
    if (compute != CUBLAS_COMPUTE_32F) return CUBLAS_STATUS_INVALID_VALUE;
    if (batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
    if (batch == 0) return h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
    check_range(Aarray, (size_t)batch * sizeof(void *), "cublasGemmBatchedEx Aarray");
    check_range(Barray, (size_t)batch * sizeof(void *), "cublasGemmBatchedEx Barray");
    check_range(Carray, (size_t)batch * sizeof(void *), "cublasGemmBatchedEx Carray");
    /* the pointer arrays are device memory too: open while read (each product opens its operands) */
    emu_op_scope op("cuBLAS", "cublasGemmBatchedEx", {(const void *)Aarray, (const void *)Barray, (const void *)Carray});
    for (int b = 0; b < batch; b++) {
        cublasStatus_t s = emu_gemm("cublasGemmBatchedEx", h, ta, tb, m, n, k, *(const float *)alpha, Aarray[b], at, lda, 0, Barray[b], bt,
                                    ldb, 0, *(const float *)beta, Carray[b], ct, ldc, 0, 1);
        if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
    return CUBLAS_STATUS_SUCCESS;
}
