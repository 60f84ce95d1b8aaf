"""Child processes that run risky calls (compiles, kernel launches) under a time limit.

A kernel that hangs cannot be interrupted inside the process that launched it, and one that
crashes takes its process down; so candidates are compiled and run in long-lived spawned children,
killed and restarted when a call passes its time limit or the child dies. Children ignore SIGINT
(the parent handles Ctrl-C and ends them) and, on Linux, die with their parent even when it is
killed outright. Children are always started from the main thread: the parent-death signal fires
when the thread that started a child exits.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


class ChildError(Exception):
    """A call that did not return: the child raised, crashed or passed its time limit."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"{kind}: {reason}")
        self.kind = kind  # "error", "crash" or "timeout"
        self.reason = reason


@dataclass(frozen=True)
class Outcome:
    """The result of one call of `run_parallel`: a value or a `ChildError`."""

    value: Any = None
    error: ChildError | None = None


class Child:
    """One spawned process serving calls of picklable module-level functions, one at a time."""

    def __init__(self, name: str, env: dict[str, str] | None = None, nice: int = 0):
        self.name = name
        self.env = env or {}
        self.nice = nice  # added to the child's scheduling niceness (compilers yield to timing)
        self._process: mp.process.BaseProcess | None = None
        self._conn: mpc.Connection | None = None
        self._busy_since: float | None = None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    @property
    def connection(self) -> mpc.Connection:
        assert self._conn is not None, "child not started"
        return self._conn

    def start(self) -> None:
        """Start the process if it is not running (call from the main thread)."""
        if self.alive:
            return
        self.kill()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)  # spawned children inherit the environment at start
        try:
            self._process = ctx.Process(target=_serve, args=(child, os.getpid(), self.nice),
                                        name=self.name, daemon=True)
            self._process.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        self._conn = parent

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self.start()
        self.connection.send((fn, args))
        self._busy_since = time.monotonic()

    def receive(self) -> Any:
        """The result of the submitted call (it must be ready); raises `ChildError`."""
        self._busy_since = None
        try:
            status, payload = self.connection.recv()
        except (EOFError, OSError):
            code = self._process.exitcode if self._process else None
            if self._process is not None:
                self._process.join(1)
                code = self._process.exitcode
            self.kill()
            raise ChildError("crash", _exit_reason(code)) from None
        if status == "ok":
            return payload
        raise ChildError("error", payload)

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """Run `fn(*args)` in the child; kill the child if it takes longer than `timeout`."""
        self.submit(fn, *args)
        if not self.connection.poll(timeout):
            self.kill()
            raise ChildError("timeout", f"no result after {timeout:g} s; child process killed")
        return self.receive()

    def kill(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn, self._busy_since = None, None, None

    def hang_up(self) -> None:
        """Ask an idle child to exit (it does when its pipe closes), without waiting for it."""
        if self._conn is not None and self._busy_since is None and self.alive:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        """End the child politely (a busy one at once), killing it if it lingers."""
        self.hang_up()
        if self._conn is None and self._process is not None and self._process.is_alive():
            self._process.join(2)
        self.kill()


def close_all(children: Iterable[Child]) -> None:
    """End children together: all are asked to exit before any is waited for."""
    children = list(children)
    for child in children:
        child.hang_up()
    for child in children:
        child.close()


class Pool:
    """Calls spread over children, each under a time limit, collected as they finish.

    Single-threaded (the caller polls `finished`), so children are (re)started from the thread
    that uses the pool. A child whose call passes its time limit is killed, its call answered with
    a timeout, and restarted at its next call.
    """

    def __init__(self, children: list[Child], timeout: float):
        self.timeout = timeout
        self._idle = list(children)
        self._running: dict[Any, tuple[Child, Any, float]] = {}  # connection -> call

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def busy(self) -> int:
        return len(self._running)

    def submit(self, tag: Any, fn: Callable[..., Any], *args: Any) -> None:
        """Start `fn(*args)` on an idle child (there must be one); `tag` names it in `finished`."""
        child = self._idle.pop()
        child.submit(fn, *args)
        self._running[child.connection] = (child, tag, time.monotonic() + self.timeout)

    def finished(self, block: bool = False) -> list[tuple[Any, Outcome]]:
        """The calls that ended since the last look, as (tag, outcome); with `block`, wait until at
        least one has (when any is running)."""
        done: list[tuple[Any, Outcome]] = []
        while self._running:
            wait = max(0.0, min(d for _, _, d in self._running.values()) - time.monotonic())
            for conn in mpc.wait(list(self._running), timeout=wait if block else 0):
                child, tag, _ = self._running.pop(conn)
                done.append((tag, _outcome(child.receive)))
                self._idle.append(child)
            now = time.monotonic()
            for conn, (child, tag, deadline) in list(self._running.items()):
                if now >= deadline:
                    del self._running[conn]
                    child.kill()
                    done.append((tag, Outcome(error=ChildError(
                        "timeout", f"no result after {self.timeout:g} s; child process killed"))))
                    self._idle.append(child)
            if done or not block:
                break
        return done


def run_parallel(children: list[Child], fn: Callable[..., Any], items: Iterable[tuple],
                 timeout: float) -> list[Outcome]:
    """Run `fn(*item)` for every item on the children, each call under `timeout` seconds."""
    pending = list(enumerate(items))
    results: list[Outcome | None] = [None] * len(pending)
    pool = Pool(children, timeout)
    pending.reverse()
    while pending or pool.busy:
        while pending and pool.idle:
            index, item = pending.pop()
            pool.submit(index, fn, *item)
        for index, outcome in pool.finished(block=True):
            results[index] = outcome
    return [r if r is not None else Outcome(error=ChildError("crash", "lost")) for r in results]


def _outcome(receive: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(value=receive())
    except ChildError as e:
        return Outcome(error=e)


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "child process died"
    if code < 0:
        try:
            return f"child process killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"child process killed by signal {-code}"
    return f"child process exited with code {code}"


def _serve(conn: mpc.Connection, parent_pid: int, nice: int = 0) -> None:
    """The child's loop: receive (fn, args), send back ("ok", value) or ("error", text)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    if nice:
        os.nice(nice)
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        try:
            reply = ("ok", fn(*args))
        except BaseException as e:  # every failure goes back to the parent
            reply = ("error", _describe(e))
        try:
            conn.send(reply)
        except Exception as e:  # an unpicklable result
            conn.send(("error", f"result not transferable: {_describe(e)}"))
        sys.stdout.flush()


def _describe(e: BaseException) -> str:
    """`Type: message` (its first lines) and where it was raised, short enough to store."""
    text = str(e).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    head = " / ".join(lines[:3]) if len(lines) <= 3 else " / ".join(lines[:2] + lines[-1:])
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {head[:600]}{where}"


def _die_with_parent(parent_pid: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    except OSError:
        pass
