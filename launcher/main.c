/* main.c: the fsdp-lua executable. It embeds LuaJIT, points package.path at
 * the fsdp Lua library, starts the runtime (MPI under mpirun) and hands the
 * command line to lua/fsdp/cli.lua, which does everything else.
 *
 * The engine is linked in and the executable exports its symbols, so Lua
 * reaches the engine through ffi.C; the fsdp_repl_* functions of the REPL
 * (repl_keys.c, repl_ranks.c, repl_terminal.c) are reached the same way by
 * lua/fsdp/repl.lua. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>

#include "fsdp.h"
#include "repl_launcher.h"

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

#ifndef FSDP_GIT_COMMIT
#define FSDP_GIT_COMMIT ""
#endif

/* package.loaded["fsdp.build"] = { commit = "<the source's git commit at
 * configure time, "" outside a checkout>" } (fsdp.metrics records it). */
static void set_build_info(lua_State *L) {
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "loaded");
    lua_createtable(L, 0, 1);
    lua_pushstring(L, FSDP_GIT_COMMIT);
    lua_setfield(L, -2, "commit");
    lua_setfield(L, -2, "fsdp.build");
    lua_pop(L, 2);
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
    if (getenv("FSDP_REPL_TERMINAL_GUARD")) return repl_terminal_guard();
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
    repl_keys_set_lua(L);
    set_path(L);
    set_build_info(L);

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
