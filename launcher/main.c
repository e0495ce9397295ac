/* main.c: the fsdp-lua executable. It embeds LuaJIT, points package.path at
 * the fsdp Lua library, starts the runtime (MPI under mpirun) and hands the
 * command line to lua/fsdp/cli.lua, which does everything else.
 *
 * The engine is linked in and the executable exports its symbols, so Lua
 * reaches the engine through ffi.C; the fsdp_repl_* functions below are
 * reached the same way by lua/fsdp/repl.lua. */
#define _GNU_SOURCE   /* POSIX_SPAWN_SETSID */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>

#include "fsdp.h"

#include <mpi.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <unistd.h>
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdbool.h>
#include <sys/select.h>
#include <termios.h>
#include <time.h>

void fsdp_repl_free(char *p) { free(p); }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- Ctrl-C: the REPL interrupts the running chunk ----
 * While a chunk runs, SIGINT sets a Lua hook that raises "interrupted" at
 * the next Lua instruction (as luajit itself does); while reading a line,
 * it clears the line. */
static lua_State *g_L;
static volatile sig_atomic_t g_sigint_mode;   /* 0 default action, 1 chunk running, 2 reading */
static volatile sig_atomic_t g_sigint_seen;

static void interrupt_hook(lua_State *L, lua_Debug *ar) {
    (void)ar;
    lua_sethook(L, NULL, 0, 0);
    luaL_error(L, "interrupted");
}

static void on_sigint(int sig) {
    if (g_sigint_mode == 1 && g_sigint_seen) {
        /* a second Ctrl-C before the first took effect (the chunk is inside a
         * long C call): the default action, ending the process */
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    g_sigint_seen = 1;
    if (g_sigint_mode == 1 && g_L)
        lua_sethook(g_L, interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
}

/* mode: 0 default SIGINT (ends the process), 1 a chunk runs, 2 reading with
 * readline (the read is interrupted), 3 reading without (it goes on).
 * Returns 1 when a SIGINT came since the last call. */
int fsdp_repl_sigint(int mode) {
    int seen = g_sigint_seen;
    g_sigint_seen = 0;
    if (mode == 0) {
        signal(SIGINT, SIG_DFL);
    } else {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_sigint;
        sa.sa_flags = mode == 3 ? SA_RESTART : 0;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, NULL);
    }
    if (mode != 1 && g_L) lua_sethook(g_L, NULL, 0, 0);
    g_sigint_mode = mode;
    return seen;
}

#ifdef FSDP_HAVE_READLINE
#include <readline/readline.h>
#include <readline/history.h>

/* Tab completion: the REPL registers a Lua function (an FFI callback) that
 * is given the line and the word's start and end, and calls
 * fsdp_repl_add_completion for each candidate. */
typedef void (*fsdp_repl_completer)(const char *line, int start, int end);
static fsdp_repl_completer g_completer;
static char **g_cands;
static int g_ncand, g_capcand, g_nextcand;

void fsdp_repl_add_completion(const char *s) {
    if (g_ncand == g_capcand) {
        int cap = g_capcand ? 2 * g_capcand : 64;
        char **p = realloc(g_cands, (size_t)cap * sizeof *p);
        if (!p) return;
        g_capcand = cap;
        g_cands = p;
    }
    char *c = strdup(s);
    if (c) g_cands[g_ncand++] = c;
}

static char *next_candidate(const char *text, int state) {
    (void)text;
    if (state == 0) g_nextcand = 0;
    return g_nextcand < g_ncand ? g_cands[g_nextcand++] : NULL;   /* readline frees them */
}

static char **complete(const char *text, int start, int end) {
    rl_attempted_completion_over = 1;   /* never file names */
    rl_completion_append_character = '\0';   /* reset by readline before each completion */
    if (start == end && (start == 0 || strchr(" \t", rl_line_buffer[start - 1]))) {
        rl_insert_text("  ");            /* Tab at the start of a word indents */
        return NULL;
    }
    g_ncand = 0;
    if (g_completer) g_completer(rl_line_buffer, start, end);
    int taken = g_ncand;
    char **m = taken ? rl_completion_matches(text, next_candidate) : NULL;
    for (int i = g_nextcand; i < taken; i++) free(g_cands[i]);   /* those readline did not take */
    g_ncand = 0;
    return m;
}

void fsdp_repl_set_completer(fsdp_repl_completer f) { g_completer = f; }

/* readline's callback interface, so that a Ctrl-C (SIGINT interrupts the
 * select) can drop the line at once: the prompt comes back empty. */
static char *g_line;
static int g_line_done;
static void on_line(char *line) {
    g_line = line;
    g_line_done = 1;
    rl_callback_handler_remove();
}

/* Line editing for the REPL. The result is malloc'd (fsdp_repl_free); NULL
 * at EOF. *interrupted is 1 when Ctrl-C dropped the line (the result is ""). */
char *fsdp_repl_readline(const char *prompt, int *interrupted) {
    static int ready = 0;
    if (!ready) {
        rl_readline_name = "fsdp-lua";
        rl_attempted_completion_function = complete;
        rl_completer_word_break_characters = " \t\n\"'><=;|&{}()[]+-*/%^~,#";
        rl_basic_quote_characters = "";
        rl_completion_append_character = '\0';
        rl_catch_signals = 0;   /* SIGINT is the REPL's (fsdp_repl_sigint) */
        ready = 1;
    }
    if (interrupted) *interrupted = 0;
    g_line = NULL;
    g_line_done = 0;
    rl_callback_handler_install(prompt, on_line);
    int fd = fileno(rl_instream ? rl_instream : stdin);
    while (!g_line_done) {
        fd_set fds;
        FD_ZERO(&fds);
        FD_SET(fd, &fds);
        int r = select(fd + 1, &fds, NULL, NULL, NULL);
        if (r < 0 && errno == EINTR) {
            if (!g_sigint_seen) continue;
            g_sigint_seen = 0;
            rl_free_line_state();
            rl_callback_sigcleanup();
            rl_callback_handler_remove();
            fputs("^C", rl_outstream ? rl_outstream : stdout);
            rl_crlf();
            if (interrupted) *interrupted = 1;
            return strdup("");
        }
        if (r > 0) rl_callback_read_char();
        else if (r < 0) break;
    }
    return g_line;
}
void fsdp_repl_add_history(const char *line) { add_history(line); }
/* History file I/O; 0 on success, an errno value on failure. */
int fsdp_repl_read_history(const char *path) { return read_history(path); }
int fsdp_repl_write_history(const char *path) { return write_history(path); }
#endif

/* ---- the REPL across ranks ----
 * Rank 0 reads; every rank evaluates. The REPL talks on a communicator of
 * its own (a duplicate of MPI_COMM_WORLD), so its messages never mix with
 * the collectives the chunks run. A rank whose chunk fails tells the others
 * at once (TAG_FAILED); a listener thread on each rank that is still running
 * that chunk then makes its collective waits give up (fsdp_comm_abandon):
 * they wait on collectives the failed rank will never join. After each
 * chunk all ranks exchange their outcome; after one that failed somewhere,
 * the ranks cancel the collectives some rank waits in and others never
 * issued (fsdp_repl_rejoin), so that their communicators are in step again.
 * Only when that cannot finish does the REPL end the job, with a message. */
/* TAG_FAILED: "my chunk failed: <message>"; TAG_RELAYED: "my waits were
 * given up because <reason>" (the reason it was told, passed on as is, so
 * that every rank names the rank that failed first). */
enum { TAG_FAILED = 7001, TAG_QUIT = 7002, TAG_RELAYED = 7003, TAG_INTERRUPT = 7004, NOTICE_MAX = 512 };
static MPI_Comm g_ctl = MPI_COMM_NULL;
static int g_ctl_rank, g_ctl_size;
static pthread_t g_listener;
static long long g_chunk = -1;           /* the chunk being run, or -1 between chunks */
static long long g_begun = -1;           /* the last chunk begun */
/* A notice for a chunk this rank has not begun yet: rank 0's broadcast of
 * the chunk returns before the others receive it, so rank 0 (or a rank
 * quicker than this one) may run it and fail before this rank begins it. */
static long long g_early_chunk = -1;
static char g_early_reason[NOTICE_MAX + 64];
static char g_reason[NOTICE_MAX + 64];    /* why this chunk's waits were given up, if they were */
static pthread_mutex_t g_chunk_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_t g_main_thread;

static void *listen_for_failures(void *arg) {
    (void)arg;
    char buf[NOTICE_MAX + 16];
    for (;;) {
        MPI_Status st;
        if (MPI_Recv(buf, (int)sizeof buf, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG, g_ctl, &st) != MPI_SUCCESS) break;
        if (st.MPI_TAG == TAG_QUIT) break;
        long long chunk;
        memcpy(&chunk, buf, sizeof chunk);
        if (st.MPI_TAG == TAG_INTERRUPT) {   /* Ctrl-C at rank 0's terminal: as a SIGINT here */
            pthread_mutex_lock(&g_chunk_mu);
            if (chunk == g_chunk) pthread_kill(g_main_thread, SIGINT);
            pthread_mutex_unlock(&g_chunk_mu);
            continue;
        }
        int n = 0;
        MPI_Get_count(&st, MPI_BYTE, &n);
        char reason[NOTICE_MAX + 64];
        if (st.MPI_TAG == TAG_RELAYED)
            snprintf(reason, sizeof reason, "%.*s", n - (int)sizeof chunk, buf + sizeof chunk);
        else
            snprintf(reason, sizeof reason, "rank %d failed this chunk and will not join it: %.*s", st.MPI_SOURCE,
                     n - (int)sizeof chunk, buf + sizeof chunk);
        pthread_mutex_lock(&g_chunk_mu);
        if (chunk == g_chunk) {
            if (!g_reason[0]) snprintf(g_reason, sizeof g_reason, "%s", reason);
            fsdp_comm_abandon(g_reason, NULL);
        } else if (chunk > g_begun) {
            g_early_chunk = chunk;
            snprintf(g_early_reason, sizeof g_early_reason, "%s", reason);
        }
        pthread_mutex_unlock(&g_chunk_mu);
    }
    return NULL;
}

/* Starts the control channel; returns the world size (1: nothing to do). */
int fsdp_repl_ctl_start(void) {
    int inited = 0, size = 1;
    MPI_Initialized(&inited);
    if (inited) MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size <= 1 || g_ctl != MPI_COMM_NULL) return size;
    if (MPI_Comm_dup(MPI_COMM_WORLD, &g_ctl) != MPI_SUCCESS) return -1;
    MPI_Comm_rank(g_ctl, &g_ctl_rank);
    MPI_Comm_size(g_ctl, &g_ctl_size);
    g_chunk = -1;
    g_main_thread = pthread_self();
    if (pthread_create(&g_listener, NULL, listen_for_failures, NULL) != 0) return -1;
    return size;
}

void fsdp_repl_ctl_stop(void) {
    if (g_ctl == MPI_COMM_NULL) return;
    char none = 0;
    MPI_Send(&none, 1, MPI_BYTE, g_ctl_rank, TAG_QUIT, g_ctl);
    pthread_join(g_listener, NULL);
    MPI_Comm_free(&g_ctl);
    g_ctl = MPI_COMM_NULL;
}

void fsdp_repl_ctl_barrier(void) {
    if (g_ctl != MPI_COMM_NULL) MPI_Barrier(g_ctl);
}

/* Rank 0's input to every rank: n bytes (n < 0: end of input). *out is a
 * malloc'd copy (fsdp_repl_free), *out_n its length (-1 at the end). */
int fsdp_repl_bcast(const char *in, int64_t n, char **out, int64_t *out_n) {
    long long len = n;
    if (MPI_Bcast(&len, 1, MPI_LONG_LONG, 0, g_ctl) != MPI_SUCCESS) return -1;
    *out_n = len;
    *out = malloc(len > 0 ? (size_t)len + 1 : 1);
    if (!*out) return -1;
    if (len > 0) {
        if (g_ctl_rank == 0) memcpy(*out, in, (size_t)len);
        if (MPI_Bcast(*out, (int)len, MPI_BYTE, 0, g_ctl) != MPI_SUCCESS) return -1;
    }
    (*out)[len > 0 ? len : 0] = '\0';
    return 0;
}

void fsdp_repl_chunk_begin(long long chunk) {
    pthread_mutex_lock(&g_chunk_mu);
    fsdp_comm_abandon(NULL, NULL);
    g_chunk = g_begun = chunk;
    g_reason[0] = '\0';
    if (g_early_chunk == chunk) {
        snprintf(g_reason, sizeof g_reason, "%s", g_early_reason);
        fsdp_comm_abandon(g_reason, NULL);
    }
    pthread_mutex_unlock(&g_chunk_mu);
}

/* Ends a chunk: a failed rank (err != NULL) tells the others first (a
 * rank whose waits were given up passes on why instead). Then
 * every rank's record reaches every rank: *out holds, per rank, an int64
 * length n, then n bytes: an int64 count of the collective waits that rank
 * gave up, then its record (the outcome, as the REPL writes it). */
int fsdp_repl_chunk_end(const char *err, const char *record, int64_t record_n, char **out, int64_t *out_n) {
    long long chunk = g_chunk;
    MPI_Request *reqs = NULL;
    char notice[NOTICE_MAX + 16];
    /* This rank is done with the chunk: later notices are ignored, and no
     * wait of the chunk is left to give up. */
    int64_t abandoned = 0;
    char relayed[sizeof g_reason] = "";
    pthread_mutex_lock(&g_chunk_mu);
    g_chunk = -1;
    fsdp_comm_abandon(NULL, &abandoned);
    if (abandoned > 0 && err && g_reason[0]) {
        snprintf(relayed, sizeof relayed, "%s", g_reason);
        err = relayed;
    }
    pthread_mutex_unlock(&g_chunk_mu);
    if (err) {
        size_t n = strlen(err);
        if (n > NOTICE_MAX) n = NOTICE_MAX;
        memcpy(notice, &chunk, sizeof chunk);
        memcpy(notice + sizeof chunk, err, n);
        reqs = calloc((size_t)g_ctl_size, sizeof *reqs);
        if (!reqs) return -1;
        for (int r = 0; r < g_ctl_size; r++) {
            reqs[r] = MPI_REQUEST_NULL;
            if (r != g_ctl_rank)
                MPI_Isend(notice, (int)(sizeof chunk + n), MPI_BYTE, r, relayed[0] ? TAG_RELAYED : TAG_FAILED, g_ctl,
                          &reqs[r]);
        }
    }

    int len = (int)record_n + 8;
    char *mine = malloc((size_t)len);
    int *lens = calloc((size_t)g_ctl_size, sizeof *lens), *offs = calloc((size_t)g_ctl_size, sizeof *offs);
    int rc = mine && lens && offs ? 0 : -1;
    if (rc == 0) {
        memcpy(mine, &abandoned, 8);
        memcpy(mine + 8, record, (size_t)record_n);
    }
    if (rc == 0 && MPI_Allgather(&len, 1, MPI_INT, lens, 1, MPI_INT, g_ctl) != MPI_SUCCESS) rc = -1;
    long long total = 0;
    for (int r = 0; rc == 0 && r < g_ctl_size; r++) offs[r] = (int)total, total += lens[r];
    char *all = rc == 0 ? malloc((size_t)total + 1) : NULL;
    if (rc == 0 && !all) rc = -1;
    if (rc == 0 && MPI_Allgatherv(mine, len, MPI_BYTE, all, lens, offs, MPI_BYTE, g_ctl) != MPI_SUCCESS) rc = -1;
    if (reqs) {
        MPI_Waitall(g_ctl_size, reqs, MPI_STATUSES_IGNORE);
        free(reqs);
    }
    if (rc == 0) {
        *out = malloc((size_t)total + 8 * (size_t)g_ctl_size + 1);
        char *p = *out;
        for (int r = 0; p && r < g_ctl_size; r++) {
            int64_t l = lens[r];
            memcpy(p, &l, 8);
            memcpy(p + 8, all + offs[r], (size_t)l);
            p += 8 + l;
        }
        if (!p) rc = -1;
        else *out_n = (int64_t)(p - *out);
    }
    free(mine);
    free(all);
    free(lens);
    free(offs);
    return rc;
}

/* ---- Ctrl-C across ranks: rank 0's terminal ----
 * Under mpirun the ranks are not in the terminal's foreground process
 * group, and mpirun ends the job on SIGINT. So while the REPL runs, rank 0
 * turns the terminal's signal keys off (ISIG) and makes Ctrl-C an extra
 * end of line (VEOL) instead: the line typed so far and the Ctrl-C reach
 * mpirun as input, which forwards them to rank 0's stdin. A reader thread
 * on rank 0 reads that input all the time: lines go to the prompt; a
 * Ctrl-C drops the line being typed, or, while a chunk runs, goes to every
 * rank's listener, which interrupts that chunk as a SIGINT does on one rank
 * (a second one before the first took effect ends that rank, and so the
 * job). Ctrl-\ (VEOL2) ends the job at once. The terminal's settings come
 * back when the REPL ends; should rank 0 die first, a guard process (this
 * executable, started with FSDP_REPL_TERMINAL_GUARD set) restores them. */
static int g_tty = -1;
static struct termios g_tty_saved;
static int g_guard_fd = -1;               /* rank 0's end of the pipe the guard reads */
static pthread_t g_reader;
static pthread_mutex_t g_in_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_in_cv = PTHREAD_COND_INITIALIZER;
static char **g_lines;                    /* complete lines (malloc'd), oldest first; "" + interrupted */
static int *g_line_int;                   /* per line: 1 when a Ctrl-C ended it */
static int g_nlines, g_caplines;
static bool g_in_eof, g_reading;
void fsdp_repl_tty_end(void);

/* The guard: restores the terminal (fd 3) to the settings that come first
 * on stdin once stdin ends without the "clean" byte after them. */
static int terminal_guard(void) {
    for (int fd = 4; fd < 1024; fd++) close(fd);
    struct termios saved;
    size_t got = 0;
    while (got < sizeof saved) {
        ssize_t k = read(0, (char *)&saved + got, sizeof saved - got);
        if (k <= 0) return 0;
        got += (size_t)k;
    }
    char c = 0, last = 0;
    ssize_t k;
    while ((k = read(0, &c, 1)) != 0) {
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) break;
        last = c;
    }
    if (last != 'x') tcsetattr(3, TCSANOW, &saved);
    return 0;
}

static void push_line(char *line, int interrupted) {
    if (g_nlines == g_caplines) {
        int cap = g_caplines ? 2 * g_caplines : 16;
        char **l = realloc(g_lines, (size_t)cap * sizeof *l);
        int *f = l ? realloc(g_line_int, (size_t)cap * sizeof *f) : NULL;
        if (l) g_lines = l;
        if (f) g_line_int = f;
        if (!l || !f) {
            free(line);
            return;
        }
        g_caplines = cap;
    }
    g_lines[g_nlines] = line;
    g_line_int[g_nlines] = interrupted;
    g_nlines++;
    pthread_cond_broadcast(&g_in_cv);
}

static void send_interrupt(void) {
    long long chunk;
    pthread_mutex_lock(&g_chunk_mu);
    chunk = g_chunk;
    pthread_mutex_unlock(&g_chunk_mu);
    if (chunk < 0) return;
    for (int r = 0; r < g_ctl_size; r++) MPI_Send(&chunk, (int)sizeof chunk, MPI_BYTE, r, TAG_INTERRUPT, g_ctl);
}

static void *read_input(void *arg) {
    (void)arg;
    char buf[4096];
    char *line = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        ssize_t k = read(0, buf, sizeof buf);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        for (ssize_t i = 0; i < k; i++) {
            char c = buf[i];
            if (c == 0x1c) {   /* Ctrl-\: the way out when nothing else works */
                fsdp_repl_tty_end();
                fputs("\nfsdp-lua: Ctrl-\\ at rank 0: ending the job\n", stdout);
                fflush(stdout);
                fflush(stderr);
                _exit(130);   /* not MPI_Abort: mpirun forwards what a rank that exits wrote first */
            }
            if (c == 0x03 || c == '\n') {
                pthread_mutex_lock(&g_in_mu);
                bool reading = g_reading;
                if (c == '\n' || reading) {
                    char *done = malloc(n + 1);
                    if (done) {
                        memcpy(done, line ? line : "", n);
                        done[n] = '\0';
                        push_line(done, c == 0x03);
                    }
                }
                pthread_mutex_unlock(&g_in_mu);
                if (c == 0x03 && !reading) send_interrupt();
                n = 0;
                continue;
            }
            if (n + 1 >= cap) {
                size_t nc = cap ? 2 * cap : 256;
                char *p = realloc(line, nc);
                if (!p) continue;
                line = p;
                cap = nc;
            }
            line[n++] = c;
        }
    }
    free(line);
    pthread_mutex_lock(&g_in_mu);
    g_in_eof = true;
    pthread_cond_broadcast(&g_in_cv);
    pthread_mutex_unlock(&g_in_mu);
    return NULL;
}

/* Rank 0, when mpirun's terminal is its user's: takes over Ctrl-C as above.
 * Returns 1 when it did, 0 when it cannot (no terminal to reach). */
int fsdp_repl_tty_begin(void) {
    if (g_tty >= 0 || g_ctl == MPI_COMM_NULL || g_ctl_rank != 0) return g_tty >= 0;
    int fd = open("/dev/tty", O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) return 0;
    struct termios t;
    if (tcgetattr(fd, &t) != 0 || (t.c_cc[VEOL] != _POSIX_VDISABLE && t.c_cc[VEOL] != 0x03)) {
        close(fd);
        return 0;
    }
    g_tty_saved = t;
    /* the guard first: it must exist before the terminal changes */
    int p[2];
    if (pipe(p) != 0) {
        close(fd);
        return 0;
    }
    fcntl(p[1], F_SETFD, FD_CLOEXEC);   /* the guard sees the end of input when rank 0 is gone */
    char exe[4096];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t sa;
    posix_spawn_file_actions_init(&fa);
    posix_spawnattr_init(&sa);
    posix_spawnattr_setflags(&sa, POSIX_SPAWN_SETSID);   /* out of the job's process groups */
    posix_spawn_file_actions_adddup2(&fa, p[0], 0);
    posix_spawn_file_actions_adddup2(&fa, fd, 3);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    char *argv[] = {"fsdp-lua", NULL};
    char *envp[] = {"FSDP_REPL_TERMINAL_GUARD=1", NULL};
    pid_t pid;
    int rc = len > 0 ? (exe[len] = '\0', posix_spawn(&pid, exe, &fa, &sa, argv, envp)) : -1;
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&sa);
    close(p[0]);
    if (rc != 0 || write(p[1], &g_tty_saved, sizeof g_tty_saved) != (ssize_t)sizeof g_tty_saved) {
        close(p[1]);
        close(fd);
        return 0;
    }
    g_guard_fd = p[1];
    /* rank 0 is not in the terminal's foreground group: SIGTTOU would stop it */
    sigset_t ttou, old;
    sigemptyset(&ttou);
    sigaddset(&ttou, SIGTTOU);
    pthread_sigmask(SIG_BLOCK, &ttou, &old);
    t.c_lflag &= ~(tcflag_t)ISIG;
    t.c_cc[VEOL] = 0x03;
    if (t.c_cc[VEOL2] == _POSIX_VDISABLE) t.c_cc[VEOL2] = 0x1c;
    rc = tcsetattr(fd, TCSANOW, &t);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    g_tty = fd;
    if (rc != 0 || pthread_create(&g_reader, NULL, read_input, NULL) != 0) {
        fsdp_repl_tty_end();
        return 0;
    }
    return 1;
}

/* The terminal as it was; the guard is told all went well. */
void fsdp_repl_tty_end(void) {
    if (g_tty < 0) return;
    sigset_t ttou, old;
    sigemptyset(&ttou);
    sigaddset(&ttou, SIGTTOU);
    pthread_sigmask(SIG_BLOCK, &ttou, &old);
    tcsetattr(g_tty, TCSANOW, &g_tty_saved);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (g_guard_fd >= 0 && write(g_guard_fd, "x", 1) == 1) close(g_guard_fd);
    g_guard_fd = -1;
    close(g_tty);
    g_tty = -1;
}

/* The next line typed at rank 0 (malloc'd; NULL at the end of input), after
 * writing the prompt. *interrupted = 1 when Ctrl-C dropped the line. */
char *fsdp_repl_tty_readline(const char *prompt, int *interrupted) {
    fputs(prompt, stdout);
    fflush(stdout);
    pthread_mutex_lock(&g_in_mu);
    g_reading = true;
    while (g_nlines == 0 && !g_in_eof) pthread_cond_wait(&g_in_cv, &g_in_mu);
    char *line = NULL;
    *interrupted = 0;
    if (g_nlines > 0) {
        line = g_lines[0];
        *interrupted = g_line_int[0];
        memmove(g_lines, g_lines + 1, (size_t)(g_nlines - 1) * sizeof *g_lines);
        memmove(g_line_int, g_line_int + 1, (size_t)(g_nlines - 1) * sizeof *g_line_int);
        g_nlines--;
    }
    g_reading = false;
    pthread_mutex_unlock(&g_in_mu);
    return line;
}

/* After a chunk that failed on some ranks: a comm thread may still wait in
 * a collective that other ranks never issued (the caller's wait was given
 * up, the collective was not). In rounds, every rank tells every other the
 * oldest collective its comm thread has not finished; a member of that
 * communicator that has not issued it issues a cancel in its place
 * (fsdp_comm_cancel: the agreement fails on every rank, no data moves),
 * and the waiting ranks go on to their next one. Every rank cancels the
 * same collectives in the same order (by communicator id, then sequence
 * number). It ends when every comm thread is idle: the ranks' sequence
 * numbers agree again. Returns the collectives this rank cancelled, or -1
 * when nothing moved for timeout_s (as rank 0 measures it, so that every
 * rank stops in the same round) or MPI failed. */
typedef struct { int64_t works; uint64_t comm_id, seq; int64_t moving; double still_s; } rejoin_state;

static int cmp_pending(const void *a, const void *b) {
    const rejoin_state *x = a, *y = b;
    if (x->comm_id != y->comm_id) return x->comm_id < y->comm_id ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

int64_t fsdp_repl_rejoin(double timeout_s) {
    int n = g_ctl_size;
    rejoin_state *all = calloc((size_t)n, sizeof *all), *prev = calloc((size_t)n, sizeof *prev);
    rejoin_state *order = calloc((size_t)n, sizeof *order);
    int64_t cancelled = 0;
    double still_since = now_s();
    int rc = all && prev && order ? 0 : -1;
    for (int round = 0; rc == 0; round++) {
        rejoin_state mine = {0};
        int moving = 0;
        fsdp_comm_pending(&mine.works, &mine.comm_id, &mine.seq, &moving);
        mine.moving = moving;
        mine.still_s = now_s() - still_since;
        if (MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, g_ctl) != MPI_SUCCESS) {
            rc = -1;
            break;
        }
        bool busy = false, changed = round == 0;
        for (int r = 0; r < n; r++) {
            busy = busy || all[r].works > 0;
            changed = changed || all[r].works != prev[r].works || all[r].comm_id != prev[r].comm_id ||
                      all[r].seq != prev[r].seq || all[r].moving;
            prev[r] = all[r];
        }
        if (!busy) break;
        if (changed) still_since = now_s();
        else if (all[0].still_s > timeout_s) rc = -1;
        if (rc != 0) break;
        memcpy(order, all, (size_t)n * sizeof *all);
        qsort(order, (size_t)n, sizeof *order, cmp_pending);
        for (int r = 0; r < n; r++) {
            if (order[r].works == 0 || order[r].seq == UINT64_MAX) continue;
            if (r > 0 && order[r].comm_id == order[r - 1].comm_id && order[r].seq == order[r - 1].seq) continue;
            int joined = 0;
            if (fsdp_comm_cancel(order[r].comm_id, order[r].seq, &joined) == FSDP_OK) cancelled += joined;
        }
        struct timespec ts = {0, 10 * 1000 * 1000};   /* the comm threads' turn */
        nanosleep(&ts, NULL);
    }
    free(all);
    free(prev);
    free(order);
    return rc == 0 ? cancelled : -1;
}

/* Message handler: the error (or what its __tostring says) and a traceback. */
static int traceback(lua_State *L) {
    const char *msg = lua_tostring(L, 1);
    if (!msg) {
        if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING)
            msg = lua_tostring(L, -1);
        else
            msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    luaL_traceback(L, L, msg, 1);
    return 1;
}

/* The Lua library: share/fsdp-lua/lua beside an installed fsdp-lua
 * (<prefix>/bin/fsdp-lua), else the source tree it was built from. */
static const char *lua_dir(void) {
    static char dir[4096];
    char exe[3072];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = '\0';
            char probe[sizeof dir + 32];
            snprintf(dir, sizeof dir, "%s/../share/fsdp-lua/lua", exe);
            snprintf(probe, sizeof probe, "%s/fsdp/init.lua", dir);
            if (access(probe, R_OK) == 0) return dir;
        }
    }
    return FSDP_LUA_DIR;
}

/* package.path: $FSDP_LUA_PATH (a path template, or a folder), then the
 * library folder, then LuaJIT's default. */
static void set_path(lua_State *L) {
    const char *env = getenv("FSDP_LUA_PATH");
    const char *lib = lua_dir();
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "path");
    const char *deflt = lua_tostring(L, -1);
    if (env && *env && strchr(env, '?'))
        lua_pushfstring(L, "%s;", env);
    else if (env && *env)
        lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;", env, env);
    else
        lua_pushliteral(L, "");
    lua_pushfstring(L, "%s%s/?.lua;%s/?/init.lua;%s", lua_tostring(L, -1), lib, lib, deflt ? deflt : "");
    lua_setfield(L, -4, "path");
    lua_pop(L, 3);
}

/* Index of the script in argv, as cli.lua will find it: after the options,
 * -e and -l taking a value; argc when there is none. */
static int script_index(int argc, char **argv) {
    int i = 1;
    while (i < argc && argv[i][0] == '-' && argv[i][1] != '\0') {
        if (strcmp(argv[i], "--") == 0) return i + 1;
        if (strcmp(argv[i], "-e") == 0 || strcmp(argv[i], "-l") == 0) i++;
        i++;
    }
    return i;
}

/* --trace=FILE before the script: the timeline of the whole run
 * (FSDP_TRACE, read by the runtime); taken out of argv. */
static int take_trace_option(int argc, char **argv) {
    int end = script_index(argc, argv);
    for (int i = 1; i < end && i < argc; i++) {
        if (strncmp(argv[i], "--trace=", 8) == 0) {
            if (!argv[i][8]) {
                fprintf(stderr, "fsdp-lua: --trace needs a file, as --trace=trace.json\n");
                exit(2);
            }
            setenv("FSDP_TRACE", argv[i] + 8, 1);
            for (int k = i; k < argc; k++) argv[k] = argv[k + 1];
            return argc - 1;
        }
    }
    return argc;
}

int main(int argc, char **argv) {
    int rank = 0, world = 1, code = 0;
    if (getenv("FSDP_REPL_TERMINAL_GUARD")) return terminal_guard();
    argc = take_trace_option(argc, argv);
    if (fsdp_runtime_init(&rank, &world) != FSDP_OK) {
        fprintf(stderr, "fsdp-lua: runtime init failed: %s\n", fsdp_last_error());
        return 1;
    }
    lua_State *L = luaL_newstate();
    if (!L) {
        fprintf(stderr, "fsdp-lua: cannot create a Lua state\n");
        fsdp_runtime_finalize();
        return 1;
    }
    luaL_openlibs(L);
    g_L = L;
    set_path(L);

    /* arg as luajit builds it: arg[0] the script, arg[-1]... the interpreter
     * and options, arg[1]... the script's arguments. */
    int script = script_index(argc, argv);
    if (script >= argc) script = 0;
    lua_createtable(L, argc - script, script + 1);
    for (int i = 0; i < argc; i++) {
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, i - script);
    }
    lua_setglobal(L, "arg");

    lua_pushcfunction(L, traceback);
    int handler = lua_gettop(L);
    int st = luaL_loadstring(L, "return require('fsdp.cli').main(...)");
    if (st == 0) {
        lua_createtable(L, argc, 0);
        for (int i = 1; i < argc; i++) {
            lua_pushstring(L, argv[i]);
            lua_rawseti(L, -2, i);
        }
        st = lua_pcall(L, 1, 1, handler);
    }
    if (st != 0) {
        const char *msg = lua_tostring(L, -1);
        const char *text = lua_pushfstring(L, "fsdp-lua: rank %d: %s", rank, msg ? msg : "(no message)");
        if (world > 1) fsdp_runtime_abort(text, 1);   /* ends every rank */
        fprintf(stderr, "%s\n", text);
        code = 1;
    } else if (lua_isnumber(L, -1)) {
        code = (int)lua_tointeger(L, -1);
    }
    lua_close(L);   /* runs the finalizers: tensors go back before the runtime ends */
    fsdp_runtime_finalize();
    return code;
}
