"""faultproxy.py - a fault-injecting TCP proxy for the integration tests (issue 13), for links
where the kernel has no netem: it forwards a listening port to a target and, on command, delays,
stalls, cuts, corrupts or refuses what passes.

Run as a program (in a network namespace with `ip netns exec NS python3 faultproxy.py ...`):

    python3 faultproxy.py --listen HOST:PORT --target HOST:PORT --control PATH

It serves commands on the Unix socket PATH (a file, so it is reachable from any network
namespace), one line each, answered with one line ("ok ..." or "error ..."):

    delay MS        hold every chunk MS milliseconds before forwarding it (0: off); order kept
    stall           stop forwarding in both directions without closing anything; new
                    connections are accepted and held, not connected to the target
    resume          end a stall: held data and held connections go on
    cut             close both sides of every open connection now (RST)
    cut_after N     close both sides of the next connection whose client-to-target stream
                    reaches byte offset N (what comes before N is forwarded); once
    corrupt N       flip (XOR 0xff) the byte at offset N of the next client-to-target stream
                    that reaches it; once
    drop on|off     close new connections as soon as they are accepted (on) or not (off)
    stats           one JSON object: connections accepted, open, bytes each way, faults done

Offsets count from the start of each connection's client-to-target stream. The FaultProxy
class below starts the program and sends it commands.
"""
import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time


class Proxy:
    def __init__(self, target):
        self.target = target
        self.delay_s = 0.0
        self.running = asyncio.Event()
        self.running.set()
        self.drop = False
        self.cut_after = None
        self.corrupt_at = None
        self.conns = set()  # (client writer, target writer or None)
        self.stats = {"accepted": 0, "dropped": 0, "bytes_up": 0, "bytes_down": 0,
                      "corrupted": 0, "cut": 0}

    async def pump(self, reader, writer, up, conn):
        """Forwards reader to writer; up: the client-to-target direction (offsets, faults)."""
        pos = 0
        try:
            while True:
                await self.running.wait()
                data = await reader.read(65536)
                if not data:
                    break
                await self.running.wait()
                if self.delay_s > 0:
                    await asyncio.sleep(self.delay_s)
                    await self.running.wait()
                if up:
                    data, cut = self.faults(pos, data)
                    pos += len(data)
                    self.stats["bytes_up"] += len(data)
                else:
                    cut = False
                    self.stats["bytes_down"] += len(data)
                writer.write(data)
                await writer.drain()
                if cut:
                    self.stats["cut"] += 1
                    self.close(conn)
                    return
        except (ConnectionError, OSError):
            pass
        self.close(conn)

    def faults(self, pos, data):
        """The chunk data at stream offset pos after the armed one-shot faults, and whether the
        connection is to be cut after it."""
        end = pos + len(data)
        if self.corrupt_at is not None and pos <= self.corrupt_at < end:
            i = self.corrupt_at - pos
            data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
            self.corrupt_at = None
            self.stats["corrupted"] += 1
        if self.cut_after is not None and end >= self.cut_after:
            data = data[:max(self.cut_after - pos, 0)]
            self.cut_after = None
            return data, True
        return data, False

    def close(self, conn):
        for w in conn:
            if w is not None and not w.is_closing():
                w.transport.abort()
        self.conns.discard(conn)

    async def accept(self, reader, writer):
        self.stats["accepted"] += 1
        if self.drop:
            self.stats["dropped"] += 1
            writer.transport.abort()
            return
        await self.running.wait()  # a stall holds new connections too
        try:
            treader, twriter = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        conn = (writer, twriter)
        self.conns.add(conn)
        await asyncio.gather(self.pump(reader, twriter, True, conn),
                             self.pump(treader, writer, False, conn))

    def command(self, line):
        words = line.split()
        if not words:
            return "error empty command"
        cmd, args = words[0], words[1:]
        if cmd == "delay" and len(args) == 1:
            self.delay_s = int(args[0]) / 1000.0
        elif cmd == "stall" and not args:
            self.running.clear()
        elif cmd == "resume" and not args:
            self.running.set()
        elif cmd == "cut" and not args:
            n = len(self.conns)
            for conn in list(self.conns):
                self.close(conn)
            self.stats["cut"] += n
            return f"ok {n}"
        elif cmd == "cut_after" and len(args) == 1:
            self.cut_after = int(args[0])
        elif cmd == "corrupt" and len(args) == 1:
            self.corrupt_at = int(args[0])
        elif cmd == "drop" and args in (["on"], ["off"]):
            self.drop = args[0] == "on"
        elif cmd == "stats" and not args:
            return "ok " + json.dumps(dict(self.stats, open=len(self.conns)))
        else:
            return f"error unknown command: {line.strip()}"
        return "ok"

    async def control(self, reader, writer):
        while True:
            line = await reader.readline()
            if not line:
                break
            try:
                answer = self.command(line.decode())
            except ValueError as e:
                answer = f"error {e}"
            writer.write(answer.encode() + b"\n")
            await writer.drain()
        writer.close()


def host_port(s):
    host, _, port = s.rpartition(":")
    return host, int(port)


async def serve(args):
    proxy = Proxy(host_port(args.target))
    listen = host_port(args.listen)
    server = await asyncio.start_server(proxy.accept, *listen, reuse_address=True)
    if os.path.exists(args.control):
        os.unlink(args.control)
    ctl = await asyncio.start_unix_server(proxy.control, args.control)
    print(f"faultproxy listening on {args.listen}, forwarding to {args.target}", flush=True)
    async with server, ctl:
        await asyncio.gather(server.serve_forever(), ctl.serve_forever())


class FaultProxy:
    """The proxy as a child process (in network namespace netns when given): forwards listen
    ("HOST:PORT") to target; commands through command() (see the module docstring)."""

    def __init__(self, listen, target, control_path, netns=None, log_path=None):
        self.listen = listen
        self.control_path = control_path
        argv = [sys.executable, os.path.abspath(__file__), "--listen", listen,
                "--target", target, "--control", control_path]
        if netns:
            argv = ["ip", "netns", "exec", netns] + argv
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.sock = None
        end = time.time() + 30
        while self.sock is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"faultproxy exited with {self.proc.returncode}")
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(control_path)
                self.sock = s
                self.reader = s.makefile("rb")
            except OSError:
                s.close()
                if time.time() > end:
                    raise RuntimeError("faultproxy: no control socket after 30 s")
                time.sleep(0.05)

    def command(self, line):
        """Sends one command; returns the answer after "ok" (raises on "error ...")."""
        self.sock.sendall(line.encode() + b"\n")
        answer = self.reader.readline().decode().strip()
        if not answer.startswith("ok"):
            raise RuntimeError(f"faultproxy {line!r}: {answer}")
        return answer[2:].strip()

    def stats(self):
        return json.loads(self.command("stats"))

    def close(self):
        if self.sock is not None:
            self.reader.close()
            self.sock.close()
            self.sock = None
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="fault-injecting TCP proxy (tests)")
    p.add_argument("--listen", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--control", required=True)
    try:
        asyncio.run(serve(p.parse_args()))
    except KeyboardInterrupt:
        pass
