/* fsdp_repl.h: what the launcher gives the REPL (lua/fsdp/repl.lua) through
 * the FFI. The region between the FFI markers is what LuaJIT sees:
 * tools/dev/gen_binding.lua makes lua/fsdp/repl_cdef.lua of it, and a test
 * fails while the two differ. Strings the launcher returns are malloc'd and
 * given back with fsdp_repl_free. */
#ifndef FSDP_REPL_H
#define FSDP_REPL_H

#include <stdint.h>

/* FFI-BEGIN */
void fsdp_repl_free(char *line);

/* ---- line editing (repl_keys.c; only in a build with readline) ---- */
/* The next line, after the prompt; NULL at the end of input. *interrupted
 * is 1 when Ctrl-C dropped the line (the result is then ""). */
char *fsdp_repl_readline(const char *prompt, int *interrupted);
void fsdp_repl_add_history(const char *line);
/* History file I/O: 0 on success, an errno value on failure. */
int fsdp_repl_read_history(const char *path);
int fsdp_repl_write_history(const char *path);
/* Tab: f(line, start, end) is called with the line and the word's bounds,
 * and answers with fsdp_repl_add_completion, once per candidate. */
typedef void (*fsdp_repl_completer)(const char *line, int start, int end);
void fsdp_repl_set_completer(fsdp_repl_completer f);
void fsdp_repl_add_completion(const char *s);

/* ---- Ctrl-C (repl_keys.c) ---- */
/* mode: 0 the default SIGINT (it ends the process), 1 a chunk runs, 2
 * reading with readline (the read is interrupted), 3 reading without (it
 * goes on). Returns 1 when a SIGINT came since the last call. */
int fsdp_repl_sigint(int mode);

/* ---- the REPL across ranks (repl_ranks.c) ---- */
/* The control channel: start returns the world size (1: nothing to do),
 * -1 when it cannot start. */
int fsdp_repl_ctl_start(void);
void fsdp_repl_ctl_stop(void);
void fsdp_repl_ctl_barrier(void);
/* Rank 0's input to every rank: n bytes (n < 0: the end of input); *out a
 * copy, *out_n its length (-1 at the end). */
int fsdp_repl_bcast(const char *in, int64_t n, char **out, int64_t *out_n);
/* A chunk's start, and its end on every rank: err (NULL: none) and this
 * rank's record in, every rank's (an int64 length, then the bytes) out. */
void fsdp_repl_chunk_begin(long long chunk);
int fsdp_repl_chunk_end(const char *err, const char *record, int64_t record_n, char **out, int64_t *out_n);
/* After a chunk that failed on some ranks: the collectives back in step
 * within timeout_s; the count of waits given up. */
int64_t fsdp_repl_rejoin(double timeout_s);
/* How long a chunk may run on one rank before it is reported (0: never). */
void fsdp_repl_set_watchdog(double seconds);

/* ---- rank 0's terminal under mpirun (repl_terminal.c) ---- */
/* Takes over Ctrl-C when mpirun's terminal is the user's: 1 when it did,
 * 0 when there is no terminal to reach; end gives the terminal back. */
int fsdp_repl_tty_begin(void);
void fsdp_repl_tty_end(void);
/* The next line typed at rank 0 after the prompt (NULL at the end of
 * input); *interrupted = 1 when Ctrl-C dropped the line. */
char *fsdp_repl_tty_readline(const char *prompt, int *interrupted);
/* FFI-END */

#endif
