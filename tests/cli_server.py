"""Runs `python -m conveyor.cli ARGS` in forked children of one interpreter that has imported the stack once.

`conveyor config` imports torch and transformers (through the config's choice
registries): a fresh interpreter spends ~10 s of CPU on that before it parses
its arguments. This server imports them once; each request is then a real child
process (forked) that runs the `conveyor.cli` module as `__main__`, the way
`python -m` does, with its own stdin (closed), stdout and stderr files, working
directory and exit status.

Protocol, one JSON object a line: the request `{"args": [...], "cwd": DIR,
"timeout": SECONDS}` on stdin; the answer `{"returncode": N, "stdout": TEXT,
"stderr": TEXT}` on stdout (a child killed for running past its timeout has
returncode -9). Nothing else is written to stdout.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback


def _child(args: list[str], cwd: str, out_path: str, err_path: str) -> None:
    code = 1
    try:
        os.chdir(cwd)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.path[0] = cwd  # as `python -m` puts the working directory first
        sys.argv = ["-m", *args]  # run_module sets argv[0] to the module's file, as `python -m` does
        runpy.run_module("conveyor.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # what the interpreter does with an uncaught SystemExit
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run(request: dict, tmp: str) -> dict:
    out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(request["args"], request["cwd"], out_path, err_path)
    deadline = time.monotonic() + request.get("timeout", 120)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    with open(out_path) as out, open(err_path) as err:
        return {"returncode": os.waitstatus_to_exitcode(status), "stdout": out.read(), "stderr": err.read()}


def main() -> None:
    from conveyor.config import load_config

    load_config(None, [])  # imports every module the config's choices come from
    import conveyor.trainer.run  # noqa: F401  - what `conveyor train` imports

    with tempfile.TemporaryDirectory() as tmp:
        for line in sys.stdin:
            sys.stdout.write(json.dumps(_run(json.loads(line), tmp)) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
