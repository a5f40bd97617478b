"""Scripts run as `python script.py ...` runs them, in processes forked from one that has already imported
what they all import (torch, transformers' model code, kvblend's engine; or vLLM): on a slow CPU a fresh
interpreter spends six seconds on those imports (vLLM: fifteen), once per script. Each child starts where
`python` would: the script's folder (for `-m`, the working directory) first on sys.path, then PYTHONPATH's,
the caller's working directory, environment (OMP_NUM_THREADS included) and arguments, stdin empty; it runs
the script as __main__ and exits with its status. `start` runs one in the background (a server), as
subprocess.Popen would, its output to a file."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVER = r"""
import json, os, runpy, sys, traceback
import torch
PRELOAD
answers = os.fdopen(os.dup(1), "w")
def answer(value):
    answers.write(json.dumps(value) + "\n")
    answers.flush()
for line in sys.stdin:
    job = json.loads(line)
    if "poll" in job:  # a background job's exit status, or None while it runs
        pid, status = os.waitpid(job["poll"], os.WNOHANG)
        answer(os.waitstatus_to_exitcode(status) if pid else None)
        continue
    pid = os.fork()
    if pid == 0:
        os.close(answers.fileno())  # only the server answers: a job must not hold its pipe open
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):  # appending: the two may share a file
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
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
    if job.get("background"):
        answer(pid)
        continue
    _, status = os.waitpid(pid, 0)
    answer(os.waitstatus_to_exitcode(status))
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
            code = self._ask(dict(args=args, cwd=str(cwd), env=env, stdout=str(out), stderr=str(err)), timeout)
            return subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())

    def start(self, args: list[str], cwd: Path, env: dict[str, str]) -> "WarmProcess":
        """The script running in the background, its stdout and stderr together in one file."""
        tmp = tempfile.TemporaryDirectory()
        out = Path(tmp.name) / "output"
        pid = self._ask(dict(args=args, cwd=str(cwd), env=env, stdout=str(out), stderr=str(out), background=True))
        return WarmProcess(self, args, pid, out, tmp)

    def _ask(self, job: dict, timeout: float = 60):
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the server and the scripts it forked
                raise TimeoutError(f"{' '.join(job.get('args', ['the warm python server']))} ran past {timeout:.0f} s")
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the warm python server died running {' '.join(job.get('args', []))}")
        return json.loads(answer)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class WarmProcess:
    """A script `WarmPython.start` runs in the background, with subprocess.Popen's poll, send_signal, kill and
    wait; `stdout` reads its output (stderr included) from the start."""

    def __init__(self, python: WarmPython, args: list[str], pid: int, output: Path, tmp):
        self.python, self.args, self.pid, self.returncode, self._tmp = python, args, pid, None, tmp
        output.touch()
        self.stdout = output.open()

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.python._ask(dict(poll=self.pid))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode
