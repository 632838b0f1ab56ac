"""Keys by default (issue 36, docs/operations.md "Keys by default"): a one-host cluster whose
config sets no CURVE keys takes per-node pairs from the user's key directory
($XDG_STATE_HOME/tandem/keys), made at the first start. Asserts that the daemons started at
once agree on one pair per id and register over CURVE; that a process without the keys cannot
register as a configured node that is not running (refused, and the reason is in tandem
status); that the key directory's permissions are checked; and that concurrent first starts
never leave two pairs for one id. Every wait is for an event, with a generous deadline.
"""
import json
import os
import re
import stat
import subprocess
import time

from conftest import BINARIES, Cluster
from tandem_client import prompt_request

KEY_IDS = ["router", "prefill-0", "prefill-1", "decode-0"]


def wait_for(pred, timeout_s, what):
    end = time.time() + timeout_s
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def status_json(c):
    out = subprocess.run([BINARIES["tandem"], "status", "--json", "--router", c.client_ep],
                         capture_output=True, check=True, text=True, timeout=60).stdout
    return json.loads(out)


def keys_default(config, state_home, extra_env=None):
    env = dict(os.environ, XDG_STATE_HOME=state_home, **(extra_env or {}))
    return subprocess.run([BINARIES["tandem"], "keys", "default", "--config", config],
                          capture_output=True, text=True, env=env, timeout=60)


def key_dir(state_home):
    return os.path.join(state_home, "tandem", "keys")


def public_keys(stdout):
    """{id: public key} from `tandem keys default`."""
    return dict(line.split() for line in stdout.splitlines()[1:])


def write_config(path, extra=""):
    with open(path, "w") as f:
        f.write("router:\n  client_endpoint: tcp://127.0.0.1:7600\n"
                "  node_endpoint: tcp://127.0.0.1:7601\n"
                "nodes:\n  - id: prefill-0\n    role: prefill\n"
                "  - id: decode-0\n    role: decode\n    kv_endpoint: tcp://127.0.0.1:7602\n"
                + extra)
    return path


def test_default_cluster_authenticates_and_refuses_processes_without_the_keys(
        tmp_path, monkeypatch):
    # a key directory of this test's own: the router and the nodes start at once and each
    # makes the missing pairs, so this is a concurrent first start
    state = str(tmp_path / "state")
    monkeypatch.setenv("XDG_STATE_HOME", state)
    c = Cluster(str(tmp_path / "c"), n_prefill=2)  # prefill-1 is configured, never started
    try:
        c._spawn("router", [BINARIES["router"], "--config", c.config])
        c._spawn("prefill-0", [BINARIES["prefill"], "--config", c.config, "--node-id",
                               "prefill-0"])
        c._spawn("decode-0", [BINARIES["decode"], "--config", c.config, "--node-id", "decode-0"])
        c.wait_up(["prefill-0", "decode-0"], 120)
        with open(c.logs["router"]) as f:
            log = f.read()
        assert f"keys by default: CURVE keys of the router and every node in {key_dir(state)}" \
            in log
        assert re.search(r'msg="router ready".* curve=on', log), log

        # 0700 directory, one 0600 secret per id of the config, no temporary file left
        st = os.stat(key_dir(state))
        assert stat.S_IMODE(st.st_mode) == 0o700
        assert sorted(os.listdir(key_dir(state))) == sorted(f"{i}.key" for i in KEY_IDS)
        for i in KEY_IDS:
            assert stat.S_IMODE(os.stat(os.path.join(key_dir(state), f"{i}.key")).st_mode) \
                == 0o600
        shown = keys_default(c.config, state)
        assert shown.returncode == 0, shown.stderr
        pubs = public_keys(shown.stdout)
        assert sorted(pubs) == sorted(KEY_IDS) and len(set(pubs.values())) == len(KEY_IDS)

        cl = c.client()
        try:
            r = cl.generate(prompt_request("The capital of France is", max_tokens=8,
                                           temperature=0.0), timeout_s=120)
            assert r.status == "OK" and len(r.token_ids) == 8, r
        finally:
            cl.close()

        # 1. a process without the keys (its own key directory: another user's, say) starts
        # as prefill-1: its CURVE handshake fails before any registration
        other = str(tmp_path / "other")
        env = dict(os.environ, XDG_STATE_HOME=other, OMP_WAIT_POLICY="passive")
        log1 = open(os.path.join(c.dir, "intruder.log"), "w")
        c.procs["intruder"] = subprocess.Popen(
            [BINARIES["prefill"], "--config", c.config, "--node-id", "prefill-1"],
            stdout=log1, stderr=subprocess.STDOUT, env=env)
        c.logs["intruder"] = log1.name

        def refusal(part):
            doc = status_json(c)
            return next((r for r in doc["refused"]
                         if r["node_id"] == "(unknown key)" and part in r["reason"]), None)

        r1 = wait_for(lambda: refusal("does not hold this server's public key"), 120,
                      "the router's Status to list the failed CURVE handshake")
        assert r1["count"] >= 1
        wait_for(lambda: "cannot authenticate with the router" in open(log1.name).read(), 120,
                 "the intruder to log that it cannot authenticate")
        assert not c.nodes()["prefill-1"].up

        # 2. one that even knows the router's public key, with a pair of its own: the router's
        # key check (ZAP) refuses its key, named in Status
        c.procs["intruder"].kill()
        c.procs["intruder"].wait()
        gen = subprocess.run([BINARIES["tandem"], "keys", "generate", "--config", c.config,
                              "--out", str(tmp_path / "own")], capture_output=True, text=True,
                             check=True, timeout=60)
        own = re.search(r'  curve_public_key: "(.{40})"', gen.stdout).group(1)
        yaml = open(c.config).read()
        extra = gen.stdout.replace(own, pubs["router"])  # the real router's public key
        router_keys = "\n".join(extra.split("\n")[2:4]) + "\n"
        nodes_keys = {m.group(1): m.group(2) for m in re.finditer(
            r"  - id: (\S+)\n(    curve_public_key: .*\n    curve_secret_key_file: .*\n)",
            extra)}
        yaml = yaml.replace("router:\n", "router:\n" + router_keys, 1)
        for nid, lines in nodes_keys.items():
            yaml = re.sub(rf"(  - id: {nid}\n)", lambda m: m.group(1) + lines, yaml)
        own_config = os.path.join(c.dir, "intruder.yaml")
        with open(own_config, "w") as f:
            f.write(yaml)
        imp_pub = nodes_keys["prefill-1"].split('"')[1]
        log2 = open(os.path.join(c.dir, "intruder2.log"), "w")
        c.procs["intruder"] = subprocess.Popen(
            [BINARIES["prefill"], "--config", own_config, "--node-id", "prefill-1"],
            stdout=log2, stderr=subprocess.STDOUT, env=env)
        r2 = wait_for(lambda: refusal(f"its public key {imp_pub} is no node's key"), 120,
                      "the router's Status to list the refused key")
        assert r2["count"] >= 1
        wait_for(lambda: "cannot authenticate with the router" in open(log2.name).read(), 120,
                 "the second intruder to log that it cannot authenticate")
        assert not c.nodes()["prefill-1"].up
        c.procs["intruder"].kill()
        c.procs["intruder"].wait()
        del c.procs["intruder"]

        # the cluster still serves
        cl = c.client()
        try:
            r = cl.generate(prompt_request("Name three rivers:", max_tokens=4,
                                           temperature=0.0), timeout_s=120)
            assert r.status == "OK" and len(r.token_ids) == 4, r
        finally:
            cl.close()
    finally:
        codes = c.stop()
    assert all(v == 0 for v in codes.values()), codes


def test_key_directory_permissions(tmp_path):
    cfg = write_config(str(tmp_path / "c.yaml"))

    # open to others: refused by the CLI and by every daemon, before anything loads
    loose = str(tmp_path / "loose")
    os.makedirs(key_dir(loose))
    os.chmod(key_dir(loose), 0o755)
    r = keys_default(cfg, loose)
    assert r.returncode == 1
    assert f"the key directory {key_dir(loose)} has mode 0755" in r.stderr
    assert f"chmod 700 {key_dir(loose)}" in r.stderr
    env = dict(os.environ, XDG_STATE_HOME=loose)
    for argv in ([BINARIES["router"], "--config", cfg],
                 [BINARIES["prefill"], "--config", cfg, "--node-id", "prefill-0"],
                 [BINARIES["decode"], "--config", cfg, "--node-id", "decode-0"]):
        d = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        assert d.returncode != 0, argv
        assert "has mode 0755" in d.stderr, d.stderr
    assert os.listdir(key_dir(loose)) == []  # nothing written into it

    # a symbolic link is not the directory
    linked = str(tmp_path / "linked")
    os.makedirs(os.path.join(linked, "tandem"))
    os.makedirs(str(tmp_path / "real"), mode=0o700)
    os.symlink(str(tmp_path / "real"), key_dir(linked))
    r = keys_default(cfg, linked)
    assert r.returncode == 1 and "is not a directory (a symbolic link)" in r.stderr, r.stderr

    # another user's directory (root can make one here)
    if os.geteuid() == 0:
        theirs = str(tmp_path / "theirs")
        os.makedirs(key_dir(theirs), mode=0o700)
        os.chown(key_dir(theirs), 65534, 65534)
        r = keys_default(cfg, theirs)
        assert r.returncode == 1
        assert f"{key_dir(theirs)} belongs to uid 65534, not to this user" in r.stderr

    # made when missing: 0700, parents too; a relative XDG_STATE_HOME is ignored (XDG spec)
    home = str(tmp_path / "home")
    os.makedirs(home)
    r = keys_default(cfg, "relative/state", {"HOME": home})
    assert r.returncode == 0, r.stderr
    made = os.path.join(home, ".local", "state", "tandem", "keys")
    assert r.stdout.splitlines()[0] == f"key directory: {made}"
    for d in (made, os.path.dirname(made)):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    # the same keys the next time
    assert keys_default(cfg, "relative/state", {"HOME": home}).stdout == r.stdout

    # a key file that is not a key: named, never replaced
    with open(os.path.join(made, "decode-0.key"), "w") as f:
        f.write("not a key\n")
    r = keys_default(cfg, "relative/state", {"HOME": home})
    assert r.returncode == 1
    assert f"{made}/decode-0.key does not hold a 40-character Z85 secret key" in r.stderr

    # no keys by default: opted out, or a cluster that is not on one host
    off = write_config(str(tmp_path / "off.yaml"), "security:\n  default_keys: false\n")
    r = keys_default(off, str(tmp_path / "s-off"))
    assert r.returncode == 1 and "security.default_keys is false" in r.stderr
    assert not os.path.exists(str(tmp_path / "s-off"))
    wide = str(tmp_path / "wide.yaml")
    with open(wide, "w") as f:
        f.write(open(cfg).read().replace("tcp://127.0.0.1:7601", "tcp://0.0.0.0:7601")
                + "security:\n  insecure: true\n")
    r = keys_default(wide, str(tmp_path / "s-wide"))
    assert r.returncode == 1 and "is not on this host" in r.stderr


def test_concurrent_first_starts_agree_on_one_pair(tmp_path):
    cfg = write_config(str(tmp_path / "c.yaml"))
    for round_ in range(4):
        state = str(tmp_path / f"s{round_}")
        env = dict(os.environ, XDG_STATE_HOME=state)
        procs = [subprocess.Popen([BINARIES["tandem"], "keys", "default", "--config", cfg],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for _ in range(12)]
        outs = [p.communicate(timeout=60) for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        assert len({o for o, _ in outs}) == 1, outs  # every process read the same pairs
        pubs = public_keys(outs[0][0])
        assert sorted(pubs) == ["decode-0", "prefill-0", "router"]
        assert sorted(os.listdir(key_dir(state))) == ["decode-0.key", "prefill-0.key",
                                                      "router.key"]
