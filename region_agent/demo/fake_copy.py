"""A fake copy's health endpoint: ``GET /global-health/<slug>`` answers as it is told.

The one fake copy of the project: ``region-agent demo`` runs one per region, tests run it in
their own event loop, benches run it as a process::

    python -m region_agent.demo.fake_copy --bind 127.0.0.11 --port 8086 \\
        --state-file /tmp/x/primary.state --log /tmp/x/primary.log

What it answers (a *behaviour*, written as one line of text everywhere)::

    ok                -> 200 "ok"
    down              -> 503 "down"
    <code> <body...>  -> <code> <body>      e.g. "200 not ok", "503 ok", "200 error"
    hang <seconds>    -> wait, then 200 "ok" (longer than the checker's timeout: a failed check)
    drop              -> close the connection without answering

In process: :meth:`HealthEndpoint.set` changes the steady behaviour and
:meth:`HealthEndpoint.once` makes only the next check(s) behave differently (one lost check).
From outside: the state file, re-read on every request, wins over the in-process state when it
exists and is not empty. Its first line is the steady behaviour; each further line
``once <behaviour>`` applies to one request, in order, after that version of the file was
written (:func:`write_state` writes by rename so every write is a new version).

Every request is recorded (:attr:`HealthEndpoint.records`) and, with ``--log``, appended as one
line when it has been answered::

    <arrival epoch> <client> <path> <status> host=<Host> ua=<User-Agent, '_' for spaces> dur=<s>

(the format of the PowerDNS anchor's health server; status 0 = dropped) so a bench can sync
to "a check landed" and tell the checkers apart by user agent. Only the standard library;
binds only where told.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PATH_PREFIX = "/global-health/"
INGRESS_PATH = "/livez"   # what cluster ingress probes ask; answers 200 while ``ingress_up``
MAX_HEADER = 16_384
HEADER_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class Behaviour:
    status: int = 200
    body: str = "ok"
    delay: float = 0.0  # seconds to wait before answering
    drop: bool = False  # close the connection without an answer

    def __str__(self) -> str:
        if self.drop:
            return "drop"
        if self.delay:
            return f"hang {self.delay:g}"
        return f"{self.status} {self.body}"


OK = Behaviour()
DOWN = Behaviour(503, "down")
DROP = Behaviour(0, "", drop=True)


def parse_behaviour(text: str) -> Behaviour:
    """One line of the state language above; raises ValueError on anything else."""
    line = text.strip()
    if line in ("", "ok"):
        return OK
    if line == "down":
        return DOWN
    if line == "drop":
        return DROP
    word, _, rest = line.partition(" ")
    if word == "hang":
        seconds = float(rest or "5")
        if seconds < 0:
            raise ValueError(f"negative hang: {line!r}")
        return Behaviour(delay=seconds)
    if not word.isdigit() or not 100 <= int(word) <= 599:
        raise ValueError(f"not a behaviour: {line!r} (ok, down, drop, hang <s>, <code> <body>)")
    return Behaviour(int(word), rest)


@dataclass(frozen=True, slots=True)
class CheckRecord:
    """One request as the endpoint saw it."""

    arrived: float  # time.time() when the connection was accepted
    finished: float
    client: str
    path: str
    status: int  # 0: dropped, or the client went away before the answer
    host: str
    user_agent: str

    def line(self) -> str:
        ua = self.user_agent.replace(" ", "_") or "-"
        return (f"{self.arrived:.6f} {self.client} {self.path} {self.status} host={self.host or '-'} ua={ua} "
                f"dur={self.finished - self.arrived:.3f}")

    @classmethod
    def from_line(cls, line: str) -> CheckRecord:
        arrived, client, path, status, host, ua, dur = line.split()
        start = float(arrived)
        ua_text = ua.removeprefix("ua=")
        return cls(start, start + float(dur.removeprefix("dur=")), client, path, int(status),
                   host.removeprefix("host="), "" if ua_text == "-" else ua_text.replace("_", " "))


def read_log(path: Path) -> list[CheckRecord]:
    """The records a ``--log`` file holds so far (a half-written last line is skipped)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            records.append(CheckRecord.from_line(line))
    return records


def write_state(path: Path, steady: str, once: str | Sequence[str] = ()) -> None:
    """Write a state file atomically: ``once`` behaviours apply to the next request(s), then ``steady``."""
    pending = [once] if isinstance(once, str) else list(once)
    for text in (steady, *pending):
        parse_behaviour(text)
    text = steady + "\n" + "".join(f"once {b}\n" for b in pending)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class HealthEndpoint:
    """One fake copy on ``host:port``; ``port=0`` picks a free port (see :attr:`port`)."""

    def __init__(self, host: str, port: int = 0, *, state_file: Path | None = None,
                 log_file: Path | None = None) -> None:
        self.host = host
        self.port = port
        self.ingress_up = True   # the region's ingress as a whole (independent of the copy's behaviour)
        self.state_file = state_file
        self.log_file = log_file
        self.behaviour = OK
        self.records: list[CheckRecord] = []
        self._once: list[Behaviour] = []
        self._file_version: tuple[int, int, int] | None = None
        self._file_once_used = 0  # 'once' lines of that version already applied
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._new_record = asyncio.Event()

    # -- control
    def set(self, behaviour: Behaviour | str) -> None:
        self.behaviour = parse_behaviour(behaviour) if isinstance(behaviour, str) else behaviour
        self._once.clear()

    def once(self, behaviour: Behaviour | str, count: int = 1) -> None:
        """The next ``count`` requests behave so, then the steady behaviour again."""
        chosen = parse_behaviour(behaviour) if isinstance(behaviour, str) else behaviour
        self._once.extend([chosen] * count)

    def _current(self) -> Behaviour:
        if self.state_file is not None:
            from_file = self._from_file()
            if from_file is not None:
                return from_file
        if self._once:
            return self._once.pop(0)
        return self.behaviour

    def _from_file(self) -> Behaviour | None:
        assert self.state_file is not None
        try:
            st = os.stat(self.state_file)
            lines = self.state_file.read_text(encoding="utf-8").splitlines()
        except OSError:
            return None
        if not lines or not lines[0].strip():
            return None
        try:
            version = (st.st_ino, st.st_mtime_ns, st.st_size)
            if version != self._file_version:
                self._file_version, self._file_once_used = version, 0
            pending = [line.removeprefix("once ") for line in lines[1:] if line.startswith("once ")]
            if self._file_once_used < len(pending):
                self._file_once_used += 1
                return parse_behaviour(pending[self._file_once_used - 1])
            return parse_behaviour(lines[0])
        except ValueError as exc:
            return Behaviour(500, f"bad state file: {exc}")

    # -- what it saw
    def checks_since(self, since: float, user_agent: str | None = None) -> list[CheckRecord]:
        """Answered requests that arrived after ``since`` (epoch), optionally from one user agent prefix."""
        return [r for r in self.records
                if r.arrived > since and (user_agent is None or r.user_agent.startswith(user_agent))]

    async def wait_check(self, since: float, *, user_agent: str | None = None, count: int = 1,
                         timeout: float = 10.0) -> CheckRecord:
        """Wait until ``count`` requests that arrived after ``since`` have been answered; returns the last."""
        async with asyncio.timeout(timeout):
            while True:
                seen = self.checks_since(since, user_agent)
                if len(seen) >= count:
                    return seen[count - 1]
                self._new_record.clear()
                await self._new_record.wait()

    # -- serving
    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, reuse_address=True,
                                                  limit=MAX_HEADER)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._handlers):
                task.cancel()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # stop() cancels connections still open; a cancelled connection callback would make asyncio
        # log a traceback per connection (StreamReaderProtocol asks the task for its exception).
        with contextlib.suppress(asyncio.CancelledError):
            await self._serve(reader, writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        arrived = time.time()
        peer = writer.get_extra_info("peername")
        client = str(peer[0]) if peer else "-"
        path, host, agent, status = "-", "", "", 0
        try:
            async with asyncio.timeout(HEADER_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split()
            path = parts[1] if len(parts) >= 2 else "-"
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "host":
                    host = value.strip()
                elif name.strip().lower() == "user-agent":
                    agent = value.strip()
            if path == INGRESS_PATH:   # the region's ingress data path itself (cluster ingress probes)
                behaviour = Behaviour(200, "ok") if self.ingress_up else Behaviour(503, "ingress down")
            elif not path.startswith(PATH_PREFIX) or len(path) == len(PATH_PREFIX):
                behaviour = Behaviour(404, "not found")
            else:
                behaviour = self._current()
            if behaviour.delay:
                await asyncio.sleep(behaviour.delay)
            if not behaviour.drop:
                body = behaviour.body.encode()
                try:
                    reason = http.HTTPStatus(behaviour.status).phrase
                except ValueError:
                    reason = "Status"
                writer.write(
                    f"HTTP/1.1 {behaviour.status} {reason}\r\nContent-Type: text/plain\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
                )
                await writer.drain()
                status = behaviour.status
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            if path != "-":
                self._record(CheckRecord(arrived, time.time(), client, path, status, host, agent))
            if task is not None:
                self._handlers.discard(task)

    def _record(self, record: CheckRecord) -> None:
        self.records.append(record)
        if self.log_file is not None:
            with open(self.log_file, "a", encoding="utf-8") as handle:
                handle.write(record.line() + "\n")
        self._new_record.set()


async def _serve(args: argparse.Namespace) -> int:
    endpoint = HealthEndpoint(args.bind, args.port, state_file=args.state_file, log_file=args.log)
    if args.state:
        endpoint.set(args.state)
    port = await endpoint.start()
    print(f"health endpoint on {args.bind}:{port} pid={os.getpid()}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await endpoint.stop()
    return 0


BEHAVIOURS = ("behaviours (the --state and the state file's first line): ok (200), down (503), "
              "'<code> <body>', 'hang <seconds>', drop (close unanswered); a state file line "
              "'once <behaviour>' applies to one request")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m region_agent.demo.fake_copy`` and ``region-agent fake-copy``."""
    parser.add_argument("--bind", required=True, help="address to listen on (127.0.0.x)")
    parser.add_argument("--port", type=int, default=8086, help="port (default 8086, the agent's health port)")
    parser.add_argument("--state-file", type=Path, help="re-read on every request; it wins over --state when "
                        "it exists and is not empty (write a new file and rename it over)")
    parser.add_argument("--state", default="", help="initial in-process behaviour (default ok)")
    parser.add_argument("--log", type=Path, help="append one line per answered request")


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM's KeyboardInterrupt; 0."""
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fake copy health endpoint (tests and benches)", epilog=BEHAVIOURS)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
