"""Scripts run as `python script.py ...` runs them, in processes forked from one that has already imported
what they all import (torch, transformers' model code, kvblend's engine; or vLLM): on a slow CPU a fresh
interpreter spends six seconds on those imports (vLLM: fifteen), once per script. Each child starts where
`python` would: the script's folder (for `-m`, the working directory) first on sys.path, then PYTHONPATH's,
the caller's working directory, environment (OMP_NUM_THREADS included) and arguments, stdin empty; it runs
the script as __main__ and exits with its status."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SERVER = r"""
import json, os, runpy, sys, traceback
import torch
PRELOAD
answers = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        sys.path[1:1] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        args, code = job["args"], 0
        try:
            if args[0] == "-m":
                sys.argv, sys.path[0] = args[1:], os.getcwd()
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv, sys.path[0] = args, os.path.dirname(os.path.abspath(args[0]))
                runpy.run_path(args[0], run_name="__main__")
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    answers.write(json.dumps(os.waitstatus_to_exitcode(status)) + "\n")
    answers.flush()
"""


KVBLEND = "import numpy, transformers, transformers.modeling_utils, kvblend.eval.harness"


class WarmPython:
    """One warm server that has run `preload`; `run` runs a script (or `-m module`) in a fork of it and
    returns its exit status and output, as subprocess.run(..., capture_output=True, text=True) would."""

    def __init__(self, env: dict[str, str], preload: str = KVBLEND):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER.replace("PRELOAD", preload)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)

    def run(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            job = dict(args=args, cwd=str(cwd), env=env, stdout=str(out), stderr=str(err))
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            with selectors.DefaultSelector() as sel:
                sel.register(self.proc.stdout, selectors.EVENT_READ)
                if not sel.select(timeout):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # the server and the script it forked
                    raise TimeoutError(f"{' '.join(args)} ran past {timeout:.0f} s")
            answer = self.proc.stdout.readline()
            if not answer:
                raise RuntimeError(f"the warm python server died running {' '.join(args)}")
            return subprocess.CompletedProcess(args, json.loads(answer), out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
