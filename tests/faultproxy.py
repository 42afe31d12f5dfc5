"""A TCP proxy for fault tests: it passes bytes both ways between the peers that connect
to it and one upstream address, and can break that path the ways networks do:
- `pause()`/`resume()`: no byte moves, the connections stay open (a link cut);
- `cut()`: every connection reset on both sides, bytes in transit lost;
- `cut_one_side("client")`: the connecting side's connection reset; the upstream side's
  kept open and silent, as a peer that never heard of the reset sees it (and the other
  way round with "upstream").
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from typing import Literal

_CHUNK = 1 << 16


def _reset(sock: socket.socket) -> None:
    """Close with an RST, dropping whatever is buffered."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class FaultProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port: int = self.listener.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._silent: list[socket.socket] = []  # kept open, never read or written
        self._lock = threading.Lock()
        self._paused = False
        self._stop = False
        self.connections = 0  # accepted so far
        self._thread = threading.Thread(target=self._run, name="faultproxy", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False

    def cut(self) -> None:
        with self._lock:
            for client, server in self._pairs:
                _reset(client)
                _reset(server)
            self._pairs.clear()

    def cut_one_side(self, side: Literal["client", "upstream"]) -> None:
        with self._lock:
            for client, server in self._pairs:
                reset, keep = (client, server) if side == "client" else (server, client)
                _reset(reset)
                self._silent.append(keep)
            self._pairs.clear()

    def close(self) -> None:
        with self._lock:
            self._stop = True
        self._thread.join(timeout=5)
        self.cut()
        for sock in self._silent:
            sock.close()
        self.listener.close()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    return
                pairs = list(self._pairs)
                paused = self._paused
            readable = [self.listener] + ([s for pair in pairs for s in pair] if not paused else [])
            ready, _, _ = select.select(readable, [], [], 0.02)
            with self._lock:
                if self.listener in ready:
                    self._accept()
                if self._paused:
                    continue
                for client, server in list(self._pairs):
                    for source, sink in ((client, server), (server, client)):
                        if source in ready and not self._move(source, sink):
                            self._drop(client, server)
                            break

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        try:
            server = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            _reset(client)
            return
        self.connections += 1
        self._pairs.append((client, server))

    def _move(self, source: socket.socket, sink: socket.socket) -> bool:
        try:
            data = source.recv(_CHUNK)
            if not data:
                return False
            sink.sendall(data)
        except OSError:
            return False
        return True

    def _drop(self, client: socket.socket, server: socket.socket) -> None:
        if (client, server) in self._pairs:
            self._pairs.remove((client, server))
        _reset(client)
        _reset(server)
