"""The fault-injecting proxy itself (faultproxy.py) against an echo server on loopback: each
command does what its docstring says. No cluster; outcomes only (bytes seen, connections
closed), every wait bounded by a generous timeout.
"""
import os
import socket
import threading

import pytest

from faultproxy import FaultProxy


@pytest.fixture
def echo():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    stop = threading.Event()

    def serve(conn):
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def accept():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[1]
    stop.set()
    srv.close()


@pytest.fixture
def proxy(echo, tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    p = FaultProxy(f"127.0.0.1:{port}", f"127.0.0.1:{echo}", os.path.join(tmp_path, "ctl"))
    p.port = port
    yield p
    p.close()


def connect(proxy):
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=30)


def read_n(c, n):
    buf = b""
    while len(buf) < n:
        try:
            b = c.recv(n - len(buf))
        except ConnectionResetError:
            break
        if not b:
            break
        buf += b
    return buf


def closed(c):
    try:
        return c.recv(1) == b""
    except (ConnectionResetError, socket.timeout):
        return True


def test_forward_and_corrupt(proxy):
    c = connect(proxy)
    c.sendall(b"hello")
    assert read_n(c, 5) == b"hello"
    proxy.command("corrupt 7")  # stream offset 7: the third byte of the next chunk
    c.sendall(b"abcdef")
    assert read_n(c, 6) == b"ab" + bytes([ord("c") ^ 0xFF]) + b"def"
    c.sendall(b"xyz")  # once only
    assert read_n(c, 3) == b"xyz"
    assert proxy.stats()["corrupted"] == 1
    c.close()


def test_stall_and_resume(proxy):
    c = connect(proxy)
    proxy.command("stall")
    c.sendall(b"held")
    c.settimeout(1.0)
    with pytest.raises(socket.timeout):
        c.recv(10)  # nothing passes, nothing is closed
    proxy.command("resume")
    c.settimeout(30)
    assert read_n(c, 4) == b"held"
    c.close()


def test_cut_cut_after_and_drop(proxy):
    c = connect(proxy)
    c.sendall(b"x")
    assert read_n(c, 1) == b"x"
    assert proxy.command("cut") == "1"
    assert closed(c)
    proxy.command("cut_after 3")
    c = connect(proxy)
    c.sendall(b"123456")
    assert read_n(c, 6) in (b"", b"1", b"12", b"123")  # at most the 3 bytes before the cut
    assert closed(c)
    c = connect(proxy)  # once only: the next connection forwards everything
    c.sendall(b"123456")
    assert read_n(c, 6) == b"123456"
    c.close()
    proxy.command("drop on")
    c = connect(proxy)
    assert closed(c)
    proxy.command("drop off")
    c = connect(proxy)
    c.sendall(b"ok")
    assert read_n(c, 2) == b"ok"
    c.close()
    st = proxy.stats()
    assert st["dropped"] == 1 and st["cut"] == 2, st


def test_delay_keeps_order(proxy):
    proxy.command("delay 50")
    c = connect(proxy)
    for i in range(5):
        c.sendall(bytes([48 + i]))
    assert read_n(c, 5) == b"01234"
    c.close()
    with pytest.raises(RuntimeError):
        proxy.command("no-such-command")
