"""Helpers shared by the serving benchmarks (bench/serve.py, bench/router_throughput.py,
bench/http_attack.py, bench/goodput.py), which run as scripts and import this module from their
own folder."""
import argparse
import math
import os
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


# Argument checks for the benchmarks' argparse options: each is a `type=` callable that turns
# the option's text into its value or raises argparse.ArgumentTypeError, which argparse reports
# as "argument --x: invalid value" with exit status 2 (never a traceback).

def int_at_least(low):
    """A `type=` for an int option that must be >= low."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v}: must be >= {low}")
        return v
    return parse


def float_text(text):
    """The float `text` spells, finite; argparse.ArgumentTypeError otherwise."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
    return v


def positive_float(text):
    """A `type=` for a float option that must be > 0 (seconds, tokens/s, GiB, ...)."""
    v = float_text(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v:g}: must be > 0")
    return v


def nonnegative_float(text):
    """A `type=` for a float option that must be >= 0."""
    v = float_text(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v:g}: must be >= 0")
    return v


def fraction(text):
    """A `type=` for a fraction in (0, 1] (an SLO attainment, a headroom)."""
    v = float_text(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{v:g}: must be in (0, 1]")
    return v


def positive_floats(text):
    """A `type=` for a comma-separated list of numbers > 0 (rates in req/s, speeds in tok/s);
    returns the text unchanged (the scripts split it themselves, and keep it in their JSON)."""
    parts = text.split(",")
    for part in parts:
        positive_float(part.strip())
    return text


def positive_floats_or_none(text):
    """positive_floats, also accepting "" (an empty list)."""
    return positive_floats(text) if text else text


def config_list(valid):
    """A `type=` for --configs: comma-separated names, each one of `valid` (a tuple), no
    repeats; returns the text unchanged."""
    def parse(text):
        names = text.split(",")
        bad = [n for n in names if n not in valid]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown configuration {bad[0]!r}: choose from {', '.join(valid)}")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"'{text}': a configuration is named twice")
        return text
    return parse


# The binaries a Tandem cluster of each kind needs, relative to the build folder
# (client/cmd_cluster_up.c finds the daemons in the tandem client's build tree).
TANDEM_BINARIES = ("client/tandem", "router/tandem-router", "decode-node/tandem-decode")
TANDEM_DISAGG_BINARIES = ("prefill-node/tandem-prefill",)


def check_inputs(ap, model, build, configs):
    """Calls ap.error (exit status 2) when the model file is missing or the build folder lacks
    a binary one of the Tandem configurations in `configs` (names) needs."""
    if not os.path.isfile(model):
        ap.error(f"--model {model}: no such file")
    tandem = [c for c in configs if c != "llama-server"]
    need = list(TANDEM_BINARIES) if tandem else []
    if any(c.startswith("disagg") for c in tandem):
        need += TANDEM_DISAGG_BINARIES
    missing = [p for p in need if not os.access(os.path.join(build, p), os.X_OK)]
    if missing:
        ap.error(f"--build {build}: {', '.join(missing)} not built "
                 "(cmake --build BUILD, or pass --build)")


def doc_paragraph(doc, start):
    """The paragraph of a module docstring that begins with `start` (for --help's epilog)."""
    return next((p.strip("\n") for p in doc.split("\n\n") if p.lstrip().startswith(start)), "")
