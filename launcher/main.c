/* main.c: the fsdp-lua executable. It embeds LuaJIT, points package.path at
 * the fsdp Lua library, starts the runtime (MPI under mpirun) and hands the
 * command line to lua/fsdp/cli.lua, which does everything else.
 *
 * The engine is linked in and the executable exports its symbols, so Lua
 * reaches the engine through ffi.C; the fsdp_repl_* functions below are
 * reached the same way by lua/fsdp/repl.lua. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>

#include "fsdp.h"

#ifdef FSDP_HAVE_READLINE
#include <readline/readline.h>
#include <readline/history.h>

/* Line editing for the REPL. The result is malloc'd (fsdp_repl_free); NULL at EOF. */
char *fsdp_repl_readline(const char *prompt) {
    static int ready = 0;
    if (!ready) {
        rl_readline_name = "fsdp-lua";
        rl_bind_key('\t', rl_insert);   /* Tab indents instead of completing file names */
        ready = 1;
    }
    return readline(prompt);
}
void fsdp_repl_add_history(const char *line) { add_history(line); }
void fsdp_repl_free(char *line) { free(line); }
/* History file I/O; 0 on success, an errno value on failure. */
int fsdp_repl_read_history(const char *path) { return read_history(path); }
int fsdp_repl_write_history(const char *path) { return write_history(path); }
#endif

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

/* package.path: $FSDP_LUA_PATH (a path template, or a folder), then the
 * library folder, then LuaJIT's default. */
static void set_path(lua_State *L) {
    const char *env = getenv("FSDP_LUA_PATH");
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "path");
    const char *deflt = lua_tostring(L, -1);
    if (env && *env && strchr(env, '?'))
        lua_pushfstring(L, "%s;", env);
    else if (env && *env)
        lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;", env, env);
    else
        lua_pushliteral(L, "");
    lua_pushfstring(L, "%s%s/?.lua;%s/?/init.lua;%s", lua_tostring(L, -1), FSDP_LUA_DIR, FSDP_LUA_DIR,
                    deflt ? deflt : "");
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

int main(int argc, char **argv) {
    int rank = 0, world = 1, code = 0;
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
