/* emu_child.h: run a piece of a test in a child process and keep what it
 * printed to stderr, for the emulation tests whose subject ends a process
 * (a refused setting, an aborted kernel, a trapped access). */
#ifndef FSDP_EMU_CHILD_H
#define FSDP_EMU_CHILD_H
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Runs fn in a child (it _exit(0)s if fn returns); buf gets its stderr, NUL
 * terminated and cut at cap - 1 bytes. Returns the child's wait status, or
 * -1 when no pipe could be made. */
static int run_child(void (*fn)(void), char *buf, size_t cap) {
    int fds[2];
    if (pipe(fds) != 0) return -1;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        fn();
        _exit(0);
    }
    close(fds[1]);
    size_t n = 0;
    ssize_t k;
    while (n + 1 < cap && (k = read(fds[0], buf + n, cap - 1 - n)) > 0) n += (size_t)k;
    buf[n] = 0;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    return status;
}
#endif
