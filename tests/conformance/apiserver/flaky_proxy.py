"""A loopback TCP proxy in front of the real kube-apiserver that can cut every connection and refuse new ones: an
API outage as a client sees it (a dead load balancer), for the outage tests of the plugin and the fleet controller.
It can also hold each answer back (``answer_delay_s``): a slow API server, for the controller's stop mid-storm.
"""

from __future__ import annotations

import socket
import threading
import time


class FlakyProxy:
    """Pipes loopback TCP connections to an upstream; while down, it cuts every open connection and refuses new ones
    (accept-and-close, what a dead load balancer in front of the API server looks like)."""

    def __init__(self, upstream: tuple[str, int], answer_delay_s: float = 0.0) -> None:
        self.upstream = upstream
        self.answer_delay_s = answer_delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.refused = 0
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                self.refused += 1
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns |= {client, server}
            asked = [0.0, False]  # when the client last sent, and whether the answer since was held back yet
            threading.Thread(target=self._pipe, args=(client, server, asked, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, asked, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, asked: list[float | bool], answers: bool) -> None:
        try:
            while data := src.recv(65536):
                if not answers:
                    asked[0], asked[1] = time.monotonic(), False
                elif self.answer_delay_s and not asked[1]:
                    # The first bytes of an answer wait until the request is answer_delay_s old: a server that takes
                    # that long to act and answer. The rest of the answer follows at once.
                    asked[1] = True
                    time.sleep(max(0.0, float(asked[0]) + self.answer_delay_s - time.monotonic()))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def down(self) -> None:
        self.up = False
        with self._lock:
            conns, self._conns = self._conns, set()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self.down()
        self.listener.close()
