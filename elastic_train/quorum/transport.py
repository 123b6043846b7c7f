"""The state a healing replica fetches from a live peer: tensors and JSON, signed with the job's secret.

torchft's own ``HTTPTransport`` pickles the state and its receiver unpickles (``weights_only=False``)
whatever the peer named by the Lighthouse serves, from a server on every interface with no
authentication: anyone who reaches the Lighthouse or a replica could run code in every replica.
``SignedStateTransport`` implements the same interface (``CheckpointTransport``) without pickle:

* the state (torchft's ``{"user": {name: state}, "torchft": {"step", "batches_committed"}}``) is
  encoded by ``encode_state``: every tensor into one safetensors blob, the structure and every
  other leaf into a JSON tree whose tags keep what JSON loses (tuples, dicts with non-string keys
  as the optimizer's ``state`` has, ``OrderedDict``); decoding is exact (bitwise tensors, the same
  Python types) and refuses anything else;
* the server binds to the job's interface (``identity.bind_address``), not every interface;
* a request is signed (HMAC-SHA256 of the path with the job's secret; a wrong or missing
  signature gets 403 and no state), and so is the body served (the receiver checks it before
  reading a byte of it: a peer without the secret cannot make a replica load anything).

Limits: the secret authenticates, it does not encrypt: the weights cross the network in clear.
A signed request can be replayed by whoever sees it, for the same step's state only. Cost
(``benchmarks/heal.py`` on the 2-core machine, a 685 MB state: AlexNet's weights and AdamW
moments; medians of 3): the source stages it in 0.59 s (0.22 s to copy the tensors into one
safetensors blob, ``tensor_blob``; 0.37 s to sign, the chunks hashed on two threads) and the
healer fetches, verifies and decodes it in 1.32 s. With safetensors' own save and load and one
SHA-256 pass per side, in the same run: 1.84 s and 1.95 s. The body is held once in memory per
side.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torchft.checkpointing.transport import CheckpointTransport

from elastic_train.quorum import tensor_blob

MAGIC = b"ETSTATE2"  # the body's first bytes: format and version (2: tensor_blob, chunked signature)
_LENGTH = struct.Struct("<Q")  # the JSON header's length, after MAGIC
HEAD_BYTES = len(MAGIC) + _LENGTH.size
SIGNATURE_HEADER = "X-Elastic-Train-Signature"
PATH_PREFIX = "/state/"
Buffer = bytes | bytearray | memoryview  # a body's parts: bytes, a received buffer, a staged blob


_SCALARS = (bool, int, float, str)


class StateTransferError(RuntimeError):
    """A state transfer failed or was refused; the message says which side and why."""


# ------------------------------------------------------------------------------- the codec
def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    # Exact types: a subclass (an IntEnum, a numpy scalar) would come back as its base type.
    # Every dict is tagged, so no key of the state is ever read as a tag.
    if value is None or type(value) in _SCALARS:
        return value
    if isinstance(value, torch.Tensor):
        if value.dtype not in tensor_blob.CODES:
            raise TypeError(
                f"state {where} is a {value.dtype} tensor: the heal transfer carries the dtypes safetensors "
                "does; convert it in the state function you registered"
            )
        name = f"t{len(tensors)}"
        tensors[name] = _own_storage(value.detach().to("cpu").contiguous(), tensors)
        return {"$tensor": name}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        pairs = [
            [_encode(k, tensors, f"{where} key"), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()
        ]
        if type(value) is OrderedDict:
            return {"$odict": pairs, "meta": _encode(getattr(value, "_metadata", None), tensors, f"{where}._metadata")}
        if type(value) is dict:
            return {"$dict": pairs}
    raise TypeError(
        f"state {where} is a {type(value).__name__}: the heal transfer carries tensors, None, bools, ints, "
        "floats, strings, lists, tuples and dicts only; convert it in the state function you registered"
    )


def _own_storage(tensor: torch.Tensor, others: dict[str, torch.Tensor]) -> torch.Tensor:
    """``tensor``, or a copy when it shares storage with one already taken (tied weights):
    safetensors refuses shared storage. No other copy: serializing copies the bytes anyway,
    before ``send_checkpoint`` returns, so what is served is the state of that moment."""
    if tensor.untyped_storage().nbytes() == 0:
        return tensor
    pointer = tensor.untyped_storage().data_ptr()
    shared = any(o.untyped_storage().nbytes() and o.untyped_storage().data_ptr() == pointer for o in others.values())
    return tensor.clone() if shared else tensor


def _decode(node: Any, tensors: dict[str, torch.Tensor], used: set[str]) -> Any:
    if node is None or type(node) in _SCALARS:
        return node
    if isinstance(node, list):
        return [_decode(v, tensors, used) for v in node]
    if not isinstance(node, dict) or len(node) not in (1, 2):
        raise ValueError(f"not a state tree node: {str(node)[:80]}")
    if set(node) == {"$tensor"}:
        name = node["$tensor"]
        if name not in tensors or name in used:
            raise ValueError(f"tensor {name!r} is missing from the state, or named twice")
        used.add(name)
        return tensors[name]
    if set(node) == {"$tuple"}:
        return tuple(_decode(v, tensors, used) for v in node["$tuple"])
    if set(node) == {"$dict"}:
        return {_decode(k, tensors, used): _decode(v, tensors, used) for k, v in node["$dict"]}
    if set(node) == {"$odict", "meta"}:
        result: OrderedDict[Any, Any] = OrderedDict(
            (_decode(k, tensors, used), _decode(v, tensors, used)) for k, v in node["$odict"]
        )
        meta = _decode(node["meta"], tensors, used)
        if meta is not None:
            result._metadata = meta  # type: ignore[attr-defined]  # nn.Module's state_dict versions
        return result
    raise ValueError(f"not a state tree node: {str(node)[:80]}")


def encode_parts(state: Any) -> tuple[bytes, Buffer]:
    """``state`` as the body's two parts, sent one after the other: MAGIC, the JSON tree's
    length and the tree; then the safetensors blob (kept apart: no copy of it is concatenated)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = json.dumps(_encode(state, tensors, "state"), separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(tree)) + tree, tensor_blob.pack(tensors)  # one copy per tensor


def encode_state(state: Any) -> bytes:
    head, blob = encode_parts(state)
    return head + bytes(blob)


def split_head(head: bytes) -> int:
    """The tree's length from the body's first ``HEAD_BYTES``; ``ValueError`` if not ours."""
    if len(head) < HEAD_BYTES or not head.startswith(MAGIC):
        raise ValueError(f"not an elastic-train state (its first bytes are {head[:8]!r}, expected {MAGIC!r})")
    return int(_LENGTH.unpack_from(head, len(MAGIC))[0])


def decode_parts(tree_json: Buffer, blob: Buffer) -> Any:
    """The state from its JSON tree and safetensors blob. Reads JSON and safetensors only:
    nothing received is ever executed; ``ValueError`` for anything ``encode_parts`` did not write."""
    try:
        tree = json.loads(bytes(tree_json))
        tensors = tensor_blob.unpack(blob)
        used: set[str] = set()
        state = _decode(tree, tensors, used)
    except (TypeError, KeyError, IndexError, ValueError, OverflowError) as exc:  # JSON's errors too
        raise ValueError(f"malformed state: {exc}") from None
    if used != set(tensors):
        raise ValueError(f"state carries tensors its tree never names: {sorted(set(tensors) - used)[:5]}")
    return state


def decode_state(body: Buffer) -> Any:
    """The inverse of ``encode_state``."""
    length = split_head(bytes(body[:HEAD_BYTES]))
    if HEAD_BYTES + length > len(body):
        raise ValueError(f"state truncated: its tree needs {length} bytes, {len(body) - HEAD_BYTES} follow")
    return decode_parts(body[HEAD_BYTES : HEAD_BYTES + length], body[HEAD_BYTES + length :])


# ----------------------------------------------------------------------------- signatures
def _sign(secret: bytes, *parts: Buffer) -> str:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(_LENGTH.pack(len(part)) + part)  # length-prefixed: no two part lists collide
    return mac.hexdigest()


def request_signature(secret: bytes, path: str) -> str:
    return _sign(secret, b"GET", path.encode())


def body_signature(secret: bytes, step: int, *body: Buffer) -> str:
    """The signature of a body served for ``step``, given whole or in consecutive parts.

    An HMAC of the step, the body's length and the SHA-256 of each ``CHUNK`` of the body, the
    chunks hashed in parallel: one SHA-256 pass over a heal's 685 MB took 0.45 s on one core, on
    each side, while the healer and the survivor waiting for it do nothing else.
    """
    mac = hmac.new(
        secret, _LENGTH.pack(6) + b"STATE2" + _LENGTH.pack(len(str(step))) + str(step).encode(), hashlib.sha256
    )
    mac.update(_LENGTH.pack(sum(len(part) for part in body)))
    for digest in chunk_digests(body):  # the parts sign as their concatenation
        mac.update(digest)
    return mac.hexdigest()


CHUNK = 16 << 20  # the signature's unit: large enough that a thread's start is nothing beside it
_hashers: tuple[int, ThreadPoolExecutor] | None = None  # (the pid it was made in, the pool)


def _pool() -> ThreadPoolExecutor:
    """This process's hashing threads. Made on first use in each process: workers are forked
    from a preloaded server (quorum/warm.py), and a pool inherited across a fork has no threads."""
    global _hashers
    with _POOL_LOCK:
        if _hashers is None or _hashers[0] != os.getpid():
            threads = max(1, min(8, len(os.sched_getaffinity(0))))  # the CPUs this process may use
            _hashers = (os.getpid(), ThreadPoolExecutor(max_workers=threads, thread_name_prefix="state-hash"))
        return _hashers[1]


_POOL_LOCK = threading.Lock()


def chunk_digests(parts: Sequence[Buffer]) -> list[bytes]:
    """SHA-256 of each ``CHUNK``-byte piece of the parts' concatenation (the last one shorter),
    computed on a thread pool: hashlib lets go of the GIL while it hashes."""
    pieces: list[list[memoryview]] = [[]]
    room = CHUNK
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            if not room:
                pieces.append([])
                room = CHUNK
            take = view[:room]
            pieces[-1].append(take)
            room -= len(take)
            view = view[len(take) :]

    def digest(chunk: list[memoryview]) -> bytes:
        h = hashlib.sha256()
        for piece in chunk:
            h.update(piece)
        return h.digest()

    if len(pieces) == 1:
        return [digest(pieces[0])]
    return list(_pool().map(digest, pieces))


# ------------------------------------------------------------------------------ transport
class _Staged:
    """What the server may serve: one step's encoded state, or nothing (between steps)."""

    def __init__(self) -> None:
        self.ready = threading.Condition()
        self.step = -1
        self.body: tuple[bytes, Buffer] | None = None  # encode_parts
        self.signature = ""

    def wait_for(self, step: int, timeout_s: float) -> tuple[tuple[bytes, Buffer], str] | None:
        """The body of ``step`` once staged (a healer may ask before its source staged it)."""
        with self.ready:
            self.ready.wait_for(lambda: self.body is not None and self.step >= step, timeout=timeout_s)
            if self.body is None or self.step != step:
                return None
            return self.body, self.signature


class SignedStateTransport(CheckpointTransport[dict[str, Any]]):  # type: ignore[misc]
    """torchft's ``CheckpointTransport`` over HTTP with no pickle, a bound interface and the job's
    secret (see the module). ``advertise``: the name peers reach this host by; ``bind``: the
    address to listen on; ``timeout``: one request (the server's socket, the receiver's read)."""

    def __init__(self, *, advertise: str, bind: str, secret: str, timeout: timedelta) -> None:
        self._advertise = advertise
        self._secret = secret.encode()
        self._timeout_s = timeout.total_seconds()
        self._staged = _Staged()
        self._server = _server(bind, self)
        self._thread = threading.Thread(target=self._server.serve_forever, name="state-transfer", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def metadata(self) -> str:
        host = f"[{self._advertise}]" if ":" in self._advertise else self._advertise
        return f"http://{host}:{self.port}{PATH_PREFIX}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta) -> None:
        body = encode_parts(state_dict)
        signature = body_signature(self._secret, step, *body)
        with self._staged.ready:
            self._staged.step, self._staged.body, self._staged.signature = step, body, signature
            self._staged.ready.notify_all()

    def disallow_checkpoint(self) -> None:
        # A response already being written keeps its own reference to the bytes.
        with self._staged.ready:
            self._staged.body = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        url = f"{metadata}{step}"
        path = urllib.parse.urlparse(url).path
        request = urllib.request.Request(url, headers={SIGNATURE_HEADER: request_signature(self._secret, path)})
        try:
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as response:
                signature = response.headers.get(SIGNATURE_HEADER, "")
                parts = _read_parts(response, url)
        except urllib.error.HTTPError as exc:
            why = "it does not share this job's secret" if exc.code == 403 else exc.reason
            raise StateTransferError(f"the peer at {url} refused the state transfer ({exc.code}: {why})") from None
        if not hmac.compare_digest(signature, body_signature(self._secret, step, *parts)):
            raise StateTransferError(
                f"the state from {url} is not signed with this job's secret: refused unread (a peer of "
                "another job, or something else answering at that address)"
            )
        try:
            state = decode_parts(parts[1], parts[2]) if len(parts) == 3 else decode_state(parts[0])
        except ValueError as exc:
            raise StateTransferError(f"the state from {url} is malformed: {exc}") from None
        if not isinstance(state, dict) or set(state) != {"user", "torchft"}:
            raise StateTransferError(f"the state from {url} is not a replica's state (keys {sorted(state)[:5]})")
        return state

    def shutdown(self, wait: bool = True) -> None:
        def stop() -> None:
            self._server.shutdown()
            self._server.server_close()

        if wait:
            stop()
            self._thread.join()
        else:  # serve_forever notices within its 0.5 s poll; nobody waits for that
            threading.Thread(target=stop, daemon=True).start()


def _read_parts(response: Any, url: str) -> list[Buffer]:
    """The body as (head, tree, blob) when its head is ours, else as it came: each part read
    into its own buffer (no slice of a large body is copied; the blob straight from the socket
    into one buffer of the announced length). Nothing here interprets it.

    The blob's buffer is allocated uninitialised, so its pages are taken only as bytes arrive
    (a zero-filled one would take all of them at once, for whatever length an unsigned header
    announced). A body that ends early is refused as truncated."""
    first = response.read(HEAD_BYTES)
    try:
        length = split_head(first)
    except ValueError:
        return [first + response.read()]
    tree = response.read(length)
    remaining = getattr(response, "length", None)  # http.client: what Content-Length has left
    if not isinstance(remaining, int):
        return [first, tree, response.read()]
    try:
        buffer = torch.empty(remaining, dtype=torch.uint8)
    except (RuntimeError, MemoryError) as exc:
        raise StateTransferError(f"the peer at {url} announced a state of {remaining} bytes: {exc}") from None
    blob = buffer.numpy().data
    got = 0
    while got < remaining:
        n = response.readinto(blob[got:])
        if not n:
            raise StateTransferError(f"the state from {url} was truncated: {got} of {remaining} bytes came")
        got += n
    return [first, tree, blob]


def _server(bind: str, transport: SignedStateTransport) -> ThreadingHTTPServer:
    staged, secret, timeout_s = transport._staged, transport._secret, transport._timeout_s

    class Handler(BaseHTTPRequestHandler):
        timeout = timeout_s  # a silent client cannot hold a thread forever

        def do_GET(self) -> None:
            given = self.headers.get(SIGNATURE_HEADER, "")
            if not hmac.compare_digest(given, request_signature(secret, self.path)):
                self.send_error(403, "not signed with this job's secret")
                return
            step_text = self.path[len(PATH_PREFIX) :] if self.path.startswith(PATH_PREFIX) else ""
            if not step_text.isdigit():
                self.send_error(404, f"expected {PATH_PREFIX}<step>")
                return
            staged_state = staged.wait_for(int(step_text), timeout_s)
            if staged_state is None:
                self.send_error(409, f"step {step_text} is not the state served now (step {staged.step})")
                return
            (head, blob), signature = staged_state
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(head) + len(blob)))
            self.send_header(SIGNATURE_HEADER, signature)
            self.end_headers()
            self.wfile.write(head)
            self.wfile.write(blob)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # every transfer is logged by the heal already

    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    server_class = type("StateServer", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True})
    return server_class((bind, 0), Handler)  # type: ignore[no-any-return]
