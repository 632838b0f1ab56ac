"""Helpers shared by the serving benchmarks (bench/serve.py, bench/router_throughput.py,
bench/http_attack.py), which run as scripts and import this module from their own folder."""
import socket


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick), as an int."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name():
    """The first "model name" of /proc/cpuinfo, or "?" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"
