/* repl_launcher.h: what the launcher's files share for the REPL among
 * themselves (what Lua reaches, the fsdp_repl_* functions, is fsdp_repl.h). */
#ifndef FSDP_REPL_LAUNCHER_H
#define FSDP_REPL_LAUNCHER_H

#include <lua.h>

/* repl_keys.c: the Lua state a SIGINT interrupts. */
void repl_keys_set_lua(lua_State *L);

/* repl_ranks.c: this rank on the REPL's channel (-1: none); Ctrl-C at rank
 * 0 sent to every rank's listener, for the chunk now running. */
int repl_rank(void);
void repl_interrupt_chunk(void);

/* repl_terminal.c: the guard process's body (the executable started with
 * FSDP_REPL_TERMINAL_GUARD set); rank 0's terminal back as it was. */
int repl_terminal_guard(void);

#endif
