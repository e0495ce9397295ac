/* repl_terminal.c: Ctrl-C across ranks, through rank 0's terminal.
 *
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
#define _GNU_SOURCE   /* POSIX_SPAWN_SETSID */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include "fsdp_repl.h"
#include "repl_launcher.h"

extern char **environ;

static pthread_mutex_t g_tty_mu = PTHREAD_MUTEX_INITIALIZER;   /* g_tty, g_guard_fd: Ctrl-\ ends from the reader thread */
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

/* The guard: restores the terminal (fd 3) to the settings that come first
 * on stdin once stdin ends without the "clean" byte after them. Once it
 * holds those settings it writes one byte to fd 1, so that rank 0 knows a
 * guard runs before it changes the terminal. */
int repl_terminal_guard(void) {
    for (int fd = 4; fd < 1024; fd++) close(fd);
    signal(SIGPIPE, SIG_IGN);
    struct termios saved;
    size_t got = 0;
    while (got < sizeof saved) {
        ssize_t k = read(0, (char *)&saved + got, sizeof saved - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return 0;
        got += (size_t)k;
    }
    if (write(1, "r", 1) != 1) return 0;
    close(1);
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
                if (c == 0x03 && !reading) repl_interrupt_chunk();
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

/* write() to the guard's pipe without SIGPIPE: a guard that is gone gives
 * EPIPE, which ends nothing (the signal, should one be raised, is taken
 * back while still blocked in this thread). */
static bool write_to_guard(int fd, const void *buf, size_t n) {
    sigset_t pipe_set, old, pending;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
    sigpending(&pending);
    bool was_pending = sigismember(&pending, SIGPIPE);
    ssize_t k;
    do k = write(fd, buf, n); while (k < 0 && errno == EINTR);
    if (k < 0 && errno == EPIPE && !was_pending) {
        struct timespec zero = {0, 0};
        sigtimedwait(&pipe_set, NULL, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return k == (ssize_t)n;
}

/* The environment for the guard: this process's (the library path the
 * executable needs among it), with FSDP_REPL_TERMINAL_GUARD=1. */
static char **guard_environment(void) {
    size_t n = 0;
    while (environ && environ[n]) n++;
    char **env = malloc((n + 2) * sizeof *env);
    if (!env) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "FSDP_REPL_TERMINAL_GUARD=", 25) != 0) env[k++] = environ[i];
    env[k++] = "FSDP_REPL_TERMINAL_GUARD=1";
    env[k] = NULL;
    return env;
}

/* Waits for the guard's "r" on ready_fd; false when it did not come (the
 * guard could not start, or died), after reaping a guard that ended. */
static bool guard_is_alive(pid_t pid, int ready_fd) {
    struct pollfd pf = {ready_fd, POLLIN, 0};
    char c = 0;
    int r;
    do r = poll(&pf, 1, 20000); while (r < 0 && errno == EINTR);
    bool alive = r == 1 && read(ready_fd, &c, 1) == 1 && c == 'r';
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) alive = false;
    return alive;
}

static void tty_unavailable(const char *why) {
    fprintf(stderr, "fsdp-lua: %s; Ctrl-C is left to mpirun (it ends the job), Ctrl-D leaves the REPL\n", why);
    fflush(stderr);
}

/* Rank 0, when mpirun's terminal is its user's: takes over Ctrl-C as above.
 * Returns 1 when it did, 0 when it cannot (no terminal to reach). */
int fsdp_repl_tty_begin(void) {
    if (g_tty >= 0 || repl_rank() != 0) return g_tty >= 0;
    int fd = open("/dev/tty", O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) return 0;
    struct termios t;
    if (tcgetattr(fd, &t) != 0 || (t.c_cc[VEOL] != _POSIX_VDISABLE && t.c_cc[VEOL] != 0x03)) {
        close(fd);
        return 0;
    }
    g_tty_saved = t;
    /* the guard first: it must exist before the terminal changes */
    int p[2], ready[2];
    if (pipe(p) != 0) {
        close(fd);
        return 0;
    }
    if (pipe(ready) != 0) {
        close(p[0]);
        close(p[1]);
        close(fd);
        return 0;
    }
    fcntl(p[1], F_SETFD, FD_CLOEXEC);   /* the guard sees the end of input when rank 0 is gone */
    fcntl(ready[0], F_SETFD, FD_CLOEXEC);
    char exe[4096];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    char **envp = guard_environment();
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t sa;
    posix_spawn_file_actions_init(&fa);
    posix_spawnattr_init(&sa);
    posix_spawnattr_setflags(&sa, POSIX_SPAWN_SETSID);   /* out of the job's process groups */
    posix_spawn_file_actions_adddup2(&fa, p[0], 0);
    posix_spawn_file_actions_adddup2(&fa, ready[1], 1);
    posix_spawn_file_actions_adddup2(&fa, fd, 3);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    char *argv[] = {"fsdp-lua", NULL};
    pid_t pid;
    int rc = len > 0 && envp ? (exe[len] = '\0', posix_spawn(&pid, exe, &fa, &sa, argv, envp)) : -1;
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&sa);
    free(envp);
    close(p[0]);
    close(ready[1]);
    bool alive = rc == 0 && write_to_guard(p[1], &g_tty_saved, sizeof g_tty_saved) &&
                 guard_is_alive(pid, ready[0]);
    close(ready[0]);
    if (!alive) {
        /* no guard: the signal keys stay on, lest a crash leave them off */
        tty_unavailable("the terminal guard did not start");
        close(p[1]);
        close(fd);
        return 0;
    }
    pthread_mutex_lock(&g_tty_mu);
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
    pthread_mutex_unlock(&g_tty_mu);
    if (rc != 0 || pthread_create(&g_reader, NULL, read_input, NULL) != 0) {
        fsdp_repl_tty_end();
        return 0;
    }
    return 1;
}

/* The terminal as it was; the guard is told all went well. */
void fsdp_repl_tty_end(void) {
    pthread_mutex_lock(&g_tty_mu);
    if (g_tty < 0) {
        pthread_mutex_unlock(&g_tty_mu);
        return;
    }
    sigset_t ttou, old;
    sigemptyset(&ttou);
    sigaddset(&ttou, SIGTTOU);
    pthread_sigmask(SIG_BLOCK, &ttou, &old);
    tcsetattr(g_tty, TCSANOW, &g_tty_saved);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (g_guard_fd >= 0) {
        write_to_guard(g_guard_fd, "x", 1);
        close(g_guard_fd);
    }
    g_guard_fd = -1;
    close(g_tty);
    g_tty = -1;
    pthread_mutex_unlock(&g_tty_mu);
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
