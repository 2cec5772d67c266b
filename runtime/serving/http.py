"""Running the embeddings app on uvicorn: slow-connection timeouts and graceful shutdown.

- :func:`build_server`: a ``uvicorn.Server`` for an app on a bound socket, whose connections
  must send their request headers within ``header_timeout`` seconds (else ``408`` and the
  connection is closed; uvicorn itself only times out idle keep-alive connections), and whose
  shutdown (SIGTERM/SIGINT, or :meth:`ServerThread.stop`) stops accepting, lets the app's
  batcher finish what is queued for the grace period (:meth:`Batcher.drain`: the rest gets
  503), and cancels whatever still runs when the grace period ends
  (uvicorn's ``timeout_graceful_shutdown``).
- :func:`serve`: the foreground server of ``python -m runtime serve``.
- :class:`ServerThread`: the same server on a background thread (tests, demo, benchmarks).

The body read timeout (408) and size limit (413) are the app's (``runtime.serving.app``).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

from .limits import GRACE, HEADER_TIMEOUT  # header timeout, shutdown grace (s)

#: Seconds an idle keep-alive connection stays open (uvicorn's ``timeout_keep_alive``).
KEEP_ALIVE = 5.0
_TIMEOUT_BODY = json.dumps({"error": {"message": "the request headers did not arrive in time",
                                      "type": "invalid_request_error", "param": None,
                                      "code": "request_timeout"}}).encode()


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket bound to ``(host, port)`` (``port=0``: a free one).

    ``proto=IPPROTO_TCP`` explicitly: asyncio sets ``TCP_NODELAY`` on accepted connections only
    when the socket says it is TCP; with proto 0, Nagle + delayed ACK add ~40 ms to every
    response written in two parts (headers, body).
    Raises: ``OSError`` (address in use, bad host).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)           # connections queue from here on, before uvicorn starts
    except OSError:
        sock.close()
        raise
    return sock


def header_timeout_protocol(base, timeout: float):
    """A subclass of uvicorn's HTTP protocol class ``base`` that answers ``408`` and closes a
    connection whose request headers are not complete ``timeout`` seconds after the connection
    opened or the request's first bytes arrived. Idle keep-alive connections are uvicorn's
    (``timeout_keep_alive``); the body is the app's."""

    class HeaderTimeoutProtocol(base):
        _header_timer = None

        def _headers_done(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is not None and not cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._headers_done():
                self._disarm()
            elif not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self._headers_done() or self.transport.is_closing():
                return
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n"
                                 b"content-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
            self.transport.close()

    return HeaderTimeoutProtocol


def build_server(app, *, grace: float = GRACE, header_timeout: float = HEADER_TIMEOUT,
                 keep_alive: float = KEEP_ALIVE, log_level: str = "warning",
                 access_log: bool = False):
    """A ``uvicorn.Server`` for ``app`` with the timeouts and graceful shutdown above.

    Args:
        app: the ASGI app (``create_app``'s; its ``state.batcher`` is drained on shutdown).
        grace: seconds for queued work and requests in flight once shutdown starts; the
            batcher gets ``grace - 1`` (at least half of it) so its 503s go out in time.
        header_timeout: seconds to send request headers (408 after).
        keep_alive: seconds an idle keep-alive connection stays open.
        log_level, access_log: uvicorn's.
    Returns: the server; run it with ``server.run(sockets=[sock])``.
    """
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    batcher = getattr(getattr(app, "state", None), "batcher", None)

    class GracefulServer(uvicorn.Server):
        """uvicorn's server; on exit, the batcher drains before connections are waited on."""

        def handle_exit(self, sig, frame) -> None:
            if batcher is not None:
                batcher.drain(max(grace - 1.0, grace / 2))
            super().handle_exit(sig, frame)

    cfg = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="off",
                         timeout_graceful_shutdown=grace, timeout_keep_alive=keep_alive,
                         http=header_timeout_protocol(AutoHTTPProtocol, header_timeout))
    return GracefulServer(cfg)


def serve(app, *, host: str = "127.0.0.1", port: int = 8000, grace: float = GRACE,
          header_timeout: float = HEADER_TIMEOUT, log_level: str = "info",
          banner: str = "serving") -> None:
    """Serve ``app`` in the foreground until SIGTERM/SIGINT, then shut down gracefully.

    Prints ``<banner> at http://host:port`` on stderr once bound (the real port when
    ``port=0``). On a signal: stop accepting, drain the batcher (queued work runs for the grace
    period, the rest gets 503), wait for requests in flight up to ``grace`` seconds, cancel the
    rest, exit (uvicorn then re-raises the signal, so the exit status says which).
    Raises: ``OSError`` when the address cannot be bound.
    """
    import signal

    from .parse import shutdown_pool

    sock = bind(host, port)
    server = build_server(app, grace=grace, header_timeout=header_timeout,
                          log_level=log_level, access_log=log_level in ("debug", "trace"))
    h = f"[{host}]" if ":" in host else host
    print(f"{banner} at http://{h}:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
    batcher = getattr(app.state, "batcher", None)
    # uvicorn re-raises SIGTERM once it has shut down; with the default action that ended the
    # process on the spot: this ``finally`` and atexit never ran, and the body-parse worker
    # process (spawned, runtime.serving.parse) and its resource tracker were left running as
    # orphans. So that SIGTERM first closes the batcher and the parse pool, then takes its
    # previous action (the default: the process still dies by it, connections still open
    # are dropped as before; not unwound through asyncio, which would cancel them with 500s).
    main = threading.current_thread() is threading.main_thread()

    def cleanup() -> None:
        sock.close()
        if batcher is not None:
            batcher.close(timeout=2.0)
        shutdown_pool()

    def on_sigterm(signum, frame):
        cleanup()
        action = signal.SIG_DFL if previous is None else previous    # None: not set from Python
        signal.signal(signum, action)
        if callable(action):
            action(signum, frame)
        elif action == signal.SIG_DFL:
            signal.raise_signal(signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm) if main else None
    try:
        server.run(sockets=[sock])
    finally:
        if main and signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous)
        cleanup()


class ServerThread:
    """Run an ASGI app with uvicorn on a background thread (tests, the demo, benchmarks).

    Args:
        app: the ASGI app; host: the interface (loopback by default); port: ``0`` picks a free
            one (the socket is bound here, before the thread starts, so there is no race).
        log_level: uvicorn's (``"warning"`` keeps the access log quiet).
        grace, header_timeout: as :func:`build_server` (``stop()`` drains the app's batcher
            for ``grace``).

    ``start()`` blocks until the server accepts connections and returns the base URL;
    ``stop()`` shuts it down and joins the thread. Also a context manager.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 grace: float = 5.0, header_timeout: float = HEADER_TIMEOUT):
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = build_server(app, grace=grace, header_timeout=header_timeout,
                                   log_level=log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="serving-http", daemon=True)

    @property
    def url(self) -> str:
        """``http://host:port``."""
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    def start(self, timeout: float = 30.0) -> str:
        """Start serving; returns :attr:`url`. Raises ``RuntimeError`` if not up in time."""
        self.thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit (as a signal would: the batcher drains) and join its thread."""
        self.server.handle_exit(None, None)
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
