"""A minimal Python client of Tandem's native API (proto/tandem.proto over ZeroMQ), for the
integration tests: frames, unary calls, streamed Generate, cancel, raw garbage.

Frame layout (docs/protocol.md): [FrameHeader][body]; the router is a ROUTER socket, we are a
DEALER. The protobuf classes are generated from proto/tandem.proto with protoc at import time.
"""
import importlib
import os
import subprocess
import sys
import tempfile
import time

import zmq

SOURCE_DIR = os.environ.get(
    "TDM_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
)
_GEN = tempfile.mkdtemp(prefix="tandem-pb2-")
subprocess.run(
    ["protoc", f"--python_out={_GEN}", f"-I{SOURCE_DIR}/proto", f"{SOURCE_DIR}/proto/tandem.proto"],
    check=True,
)
sys.path.insert(0, _GEN)
pb = importlib.import_module("tandem_pb2")

PROTOCOL_MAJOR, PROTOCOL_MINOR = 2, 1

# SamplingParams.set_mask bits (field number - 1)
SET = {
    "temperature": 1 << 0,
    "top_k": 1 << 1,
    "top_p": 1 << 2,
    "min_p": 1 << 3,
    "repetition_penalty": 1 << 4,
    "presence_penalty": 1 << 5,
    "frequency_penalty": 1 << 6,
    "penalty_last_n": 1 << 7,
    "seed": 1 << 8,
    "stop_token_ids": 1 << 10,
    "ignore_eos": 1 << 11,
    "n_logprobs": 1 << 12,
    "logit_bias": 1 << 14,
    "min_tokens": 1 << 15,
    "bad_words": 1 << 16,
    "allowed_token_ids": 1 << 17,
}

# gRPC status codes by name
CODES = {
    "OK": 0, "CANCELLED": 1, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
    "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9, "INTERNAL": 13, "UNAVAILABLE": 14,
    "UNAUTHENTICATED": 16,
}
NAMES = {v: k for k, v in CODES.items()}


def sampling(**kw):
    """SamplingParams with the given fields set (and their set_mask bits)."""
    sp = pb.SamplingParams()
    mask = 0
    for k, v in kw.items():
        if k in ("stop_token_ids", "allowed_token_ids"):
            getattr(sp, k).extend(v)
        elif k == "bad_words":  # words (str) or token sequences (lists of ids)
            for w in v:
                e = sp.bad_words.add()
                if isinstance(w, str):
                    e.text = w
                else:
                    e.ids.extend(w)
        else:
            setattr(sp, k, v)
        if k == "seed":
            sp.has_seed = True
        mask |= SET[k]
    sp.set_mask = mask
    return sp


class Result:
    """What a Generate call produced."""

    def __init__(self):
        self.status = None  # gRPC code name
        self.message = ""
        self.chunks = []
        self.token_ids = []
        self.text = ""
        self.final = None  # the last GenerateChunk (finish_reason, usage, timings)

    def __repr__(self):
        return (f"Result(status={self.status}, message={self.message!r}, n={len(self.token_ids)}, "
                f"text={self.text[:60]!r})")


class Client:
    def __init__(self, endpoint, api_key=None):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.api_key = api_key
        self.next_call = 1

    def close(self):
        self.sock.close(linger=0)

    def _header(self, kind, method, call_id, deadline_ms=0):
        h = pb.FrameHeader()
        h.version_major, h.version_minor = PROTOCOL_MAJOR, PROTOCOL_MINOR
        h.kind, h.method, h.call_id = kind, method, call_id
        h.deadline_unix_ms = deadline_ms
        if self.api_key:
            h.api_key = self.api_key
        return h

    def send(self, kind, method, body=None, call_id=None, deadline_ms=0):
        if call_id is None:
            call_id = self.next_call
            self.next_call += 1
        parts = [self._header(kind, method, call_id, deadline_ms).SerializeToString()]
        if body is not None:
            parts.append(body.SerializeToString())
        self.sock.send_multipart(parts)
        return call_id

    def send_raw(self, parts):
        self.sock.send_multipart(parts)

    def recv(self, timeout_s):
        """(FrameHeader, body bytes or None), or None on timeout."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        parts = self.sock.recv_multipart()
        h = pb.FrameHeader()
        h.ParseFromString(parts[0])
        return h, (parts[1] if len(parts) > 1 else None)

    def unary(self, method, req, resp_cls, timeout_s=10):
        call_id = self.send(pb.FRAME_KIND_REQUEST, method, req)
        end = time.time() + timeout_s
        while time.time() < end:
            got = self.recv(end - time.time())
            if got is None:
                break
            h, body = got
            if h.call_id != call_id or h.kind != pb.FRAME_KIND_END:
                continue
            if h.status != 0:
                return NAMES.get(h.status, str(h.status)), h.message, None
            resp = resp_cls()
            if body:
                resp.ParseFromString(body)
            return "OK", "", resp
        raise TimeoutError(f"no answer to method {method} in {timeout_s} s")

    def status(self):
        st, msg, resp = self.unary(pb.METHOD_STATUS, pb.StatusRequest(), pb.ClusterStatus)
        assert st == "OK", (st, msg)
        return resp

    def start(self, req, deadline_ms=0):
        return self.send(pb.FRAME_KIND_REQUEST, pb.METHOD_GENERATE, req, deadline_ms=deadline_ms)

    def cancel(self, call_id):
        self.send(pb.FRAME_KIND_CANCEL, pb.METHOD_GENERATE, call_id=call_id)

    def collect(self, results, timeout_s=300, on_chunk=None):
        """Receives until every call in results (call_id -> Result) has ended."""
        end = time.time() + timeout_s
        pending = {c for c, r in results.items() if r.status is None}
        while pending:
            left = end - time.time()
            if left <= 0:
                raise TimeoutError(f"{len(pending)} calls still open after {timeout_s} s")
            got = self.recv(left)
            if got is None:
                continue
            h, body = got
            r = results.get(h.call_id)
            if r is None or r.status is not None:
                continue
            if h.kind in (pb.FRAME_KIND_STREAM, pb.FRAME_KIND_END) and body:
                ch = pb.GenerateChunk()
                ch.ParseFromString(body)
                r.chunks.append(ch)
                r.token_ids.extend(ch.token_ids)
                r.text += ch.text
                if ch.finish_reason:
                    r.final = ch
                if on_chunk:
                    on_chunk(h.call_id, r, ch)
            if h.kind == pb.FRAME_KIND_END:
                r.status = NAMES.get(h.status, str(h.status))
                r.message = h.message
                pending.discard(h.call_id)
        return results

    def generate(self, req, timeout_s=300, deadline_ms=0):
        call_id = self.start(req, deadline_ms=deadline_ms)
        return self.collect({call_id: Result()}, timeout_s)[call_id]


def prompt_request(prompt=None, chat=None, max_tokens=16, stream=True, **sp):
    req = pb.GenerateRequest()
    if prompt is not None:
        req.prompt = prompt
    if chat is not None:
        for role, content in chat:
            m = req.chat.messages.add()
            m.role, m.content = role, content
    req.max_tokens = max_tokens
    req.stream = stream
    req.sampling.CopyFrom(sampling(**sp))
    return req
