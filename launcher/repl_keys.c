/* repl_keys.c: the REPL's keys: Ctrl-C (a running chunk is interrupted,
 * the line being read is dropped) and, when built with readline, line
 * editing, history and Tab completion. lua/fsdp/repl.lua reaches these
 * fsdp_repl_* functions through ffi.C (the executable exports them). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>

#include <lua.h>
#include <lauxlib.h>

#include "fsdp_repl.h"
#include "repl_launcher.h"

void fsdp_repl_free(char *p) { free(p); }

/* ---- Ctrl-C: the REPL interrupts the running chunk ----
 * While a chunk runs, SIGINT sets a Lua hook that raises "interrupted" at
 * the next Lua instruction (as luajit itself does); while reading a line,
 * it clears the line. */
static lua_State *g_L;
void repl_keys_set_lua(lua_State *L) { g_L = L; }
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
    /* the mode first: a SIGINT between the two must not set the hook again */
    g_sigint_mode = mode;
    if (mode != 1 && g_L) lua_sethook(g_L, NULL, 0, 0);
    return seen;
}

#ifdef FSDP_HAVE_READLINE
#include <readline/readline.h>
#include <readline/history.h>

/* Tab completion: the REPL registers a Lua function (an FFI callback) that
 * is given the line and the word's start and end, and calls
 * fsdp_repl_add_completion for each candidate. */
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
