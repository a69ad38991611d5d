"""Serve an :class:`Emulator` with uvicorn: in the foreground (the CLI) or on a background thread (tests).

Background use (e.g. a gateway test)::

    from loadtest.emulator.host import EmulatorThread
    from loadtest.emulator.app import EmulatorSettings

    with EmulatorThread(EmulatorSettings(engine="sglang", dp_size=2, port=0, kv_tokens_per_rank=4096,
                                         time_scale=0)) as emu:
        httpx.get(emu.url + "/v1/loads")     # emu.urls: one per rank with vLLM --external-lb

Port 0 picks free ports (with external LB each rank gets its own free port, not consecutive ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import TracebackType

import uvicorn

from loadtest.emulator.app import Emulator, EmulatorSettings

GRACEFUL_SHUTDOWN_S = 2


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to its host (several servers share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class EmulatorHost:
    """Runs the emulator's apps in the current event loop until :meth:`shutdown` (or a crash fault)."""

    def __init__(self, settings: EmulatorSettings, log_level: str = "warning") -> None:
        self.settings = settings
        self.crashed = False
        self.emulator = Emulator(settings, crash=self._crash)
        self.servers = [
            _Server(uvicorn.Config(
                app, host=settings.host, port=settings.port + i if settings.port else 0, log_level=log_level,
                access_log=False, lifespan="off", http="httptools", ws="none",
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            ))
            for i, app in enumerate(self.emulator.apps)
        ]  # fmt: skip
        self.started = asyncio.Event()

    @property
    def ports(self) -> list[int]:
        return [int(s.servers[0].sockets[0].getsockname()[1]) for s in self.servers]

    def _crash(self) -> None:
        """The legacy-crash fault: the whole server goes away, as old SGLang does on a bad rank."""
        self.crashed = True
        for s in self.servers:
            s.should_exit = True
            s.force_exit = True

    def shutdown(self) -> None:
        for s in self.servers:
            s.should_exit = True

    async def serve(self, on_started: Callable[[], None] | None = None) -> None:
        self.emulator.start()
        tasks = [asyncio.ensure_future(s.serve()) for s in self.servers]
        try:
            while not all(s.started for s in self.servers):
                if any(t.done() for t in tasks):  # a bind failure ends serve() early
                    break
                await asyncio.sleep(0.01)
            else:
                self.started.set()
                if on_started is not None:
                    on_started()
            while not any(s.should_exit for s in self.servers) and not all(t.done() for t in tasks):  # noqa: ASYNC110
                await asyncio.sleep(0.05)  # uvicorn exposes should_exit as a flag, not an event
            self.shutdown()
            await self.emulator.stop()  # end every open stream so connections can close
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for t in tasks:
                t.cancel()
        if not self.started.is_set():
            raise OSError(f"emulator could not listen on {self.settings.host}:{self.settings.port}")


async def serve_forever(settings: EmulatorSettings, log_level: str = "info") -> bool:
    """The CLI's loop: serve until SIGINT/SIGTERM. Returns True if the legacy-crash fault fired."""
    host = EmulatorHost(settings, log_level)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, host.shutdown)
    await host.serve()
    return host.crashed


class EmulatorThread:
    """An emulator on a daemon thread with its own event loop; a context manager for tests."""

    def __init__(self, settings: EmulatorSettings, start_timeout_s: float = 10.0) -> None:
        self.settings = settings
        self._timeout_s = start_timeout_s
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.host: EmulatorHost | None = None
        self._thread = threading.Thread(target=self._main, name="emulator", daemon=True)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self.host = EmulatorHost(self.settings)
            loop.run_until_complete(self.host.serve(on_started=self._ready.set))
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
        finally:
            self._ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def start(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(self._timeout_s) or self._error is not None or self.host is None:
            self.stop()
            raise RuntimeError(f"emulator did not start: {self._error!r}")
        return self

    @property
    def urls(self) -> list[str]:
        assert self.host is not None
        return [f"http://{self.settings.host}:{p}" for p in self.host.ports]

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def crashed(self) -> bool:
        return self.host is not None and self.host.crashed

    def stop(self) -> None:
        loop, host = self._loop, self.host
        if loop is not None and host is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(host.shutdown)
        self._thread.join(timeout=GRACEFUL_SHUTDOWN_S + 5)

    def __enter__(self) -> EmulatorThread:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
