"""Drives the fsdp-lua REPL through a pseudo-terminal (tests/sh/test_repl*.sh).

    python3 repl_pty.py SCRIPT -- COMMAND...

SCRIPT holds one step a line: `send TEXT` (Python escapes: \\n, \\t, \\x03),
`expect TEXT` (waits for TEXT in the output since the last expect), `sleep S`,
`wait RC` (the command ends with exit status RC; `wait nonzero`: any but 0),
`isig on|off` (the terminal's signal keys are on or off: within 5 s, since
a guard process may restore them just after the command). Prints STEP_OK n for each
step that passed and stops at the first that fails, printing what came.
"""
import os
import pty
import select
import sys
import termios
import time

args = sys.argv[1:]
script, cmd = args[0], args[args.index("--") + 1:]
pid, master = pty.fork()
if pid == 0:
    os.execvp(cmd[0], cmd)

buf = b""


def pump(timeout):
    global buf
    r, _, _ = select.select([master], [], [], timeout)
    if r:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            return False
        if not chunk:
            return False
        buf += chunk
    return True


def fail(what):
    print("FAILED at %s; output was:\n%s" % (what, buf.decode(errors="replace")))
    try:
        os.kill(pid, 9)
    except OSError:
        pass
    sys.exit(1)


steps = [l.rstrip("\n") for l in open(script) if l.strip() and not l.startswith("#")]
for n, step in enumerate(steps, 1):
    op, _, arg = step.partition(" ")
    text = arg.encode().decode("unicode_escape")
    if op == "send":
        os.write(master, text.encode())
    elif op == "sleep":
        time.sleep(float(arg))
    elif op == "expect":
        end = time.time() + 60
        while text.encode() not in buf:
            if time.time() > end:
                fail("step %d (%s)" % (n, step))
            if not pump(0.2):
                time.sleep(0.2)   # the command closed its terminal: no busy loop until the deadline
        buf = buf[buf.index(text.encode()) + len(text.encode()):]
    elif op == "wait":
        end = time.time() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.time() > end:
                fail("step %d (%s): still running" % (n, step))
            pump(0.2)
        rc = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
        if (rc == 0) if arg == "nonzero" else (rc != int(arg)):
            fail("step %d (%s): exit status %d" % (n, step, rc))
    elif op == "isig":
        end = time.time() + 5
        while True:
            on = bool(termios.tcgetattr(master)[3] & termios.ISIG)
            if on == (arg == "on"):
                break
            if time.time() > end:
                fail("step %d (%s): ISIG is %s" % (n, step, "on" if on else "off"))
            pump(0.1)
    else:
        fail("step %d: unknown op %r" % (n, op))
    print("STEP_OK %d %s" % (n, step))
print("ALL_OK")
