"""Raw-socket helpers for the HTTP gateway tests that speak bytes rather than a client
library: what the server sends, read until it closes the connection."""
import socket


def read_all(s):
    """Everything s receives until the server closes it (or resets it), as bytes."""
    buf = b""
    while True:
        try:
            b = s.recv(65536)
        except ConnectionResetError:
            break
        if not b:
            break
        buf += b
    return buf


def raw_all(port, data, timeout=60):
    """Sends data (bytes) on a fresh connection to 127.0.0.1:port and reads until the server
    closes it (every framing refusal closes). Returns everything read, as bytes; timeout (s)
    bounds each socket operation."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(data)
        return read_all(s)
    finally:
        s.close()
