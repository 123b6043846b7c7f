"""The heal's state transfer alone: stage a replica-sized state on one signed transport, fetch it from another.

Quorum mode's replacement fetches the survivor's whole state (weights and optimizer moments)
through ``elastic_train.quorum.transport.SignedStateTransport``. This times its two halves in one
process over loopback, a few times each, for a state of ``--mb`` megabytes in three tensors (as
a model's weights and AdamW's two moments): the survivor's part (``send_checkpoint``: copy into
the blob and sign, while it waits) and the healer's (``recv_checkpoint``: fetch, verify, decode).

    python benchmarks/heal.py [--mb 685] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from elastic_train.quorum.transport import SignedStateTransport, body_signature, encode_parts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=685, help="state size (AlexNet with AdamW: 685 MB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    n = args.mb * 1_000_000 // 4 // 3
    state = {
        "user": {"model": {"w": torch.randn(n)}, "optimizer": {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}},
        "torchft": {"step": 1, "batches_committed": 1},
    }
    sample = bytes(256_000_000)
    began = time.perf_counter()
    hashlib.sha256(sample).digest()
    sha256_mb_s = 256 / (time.perf_counter() - began)
    encode, sign, stage, fetch = [], [], [], []
    timeout = timedelta(seconds=300)
    source = SignedStateTransport(advertise="127.0.0.1", bind="127.0.0.1", secret="s", timeout=timeout)
    healer = SignedStateTransport(advertise="127.0.0.1", bind="127.0.0.1", secret="s", timeout=timeout)
    try:
        for step in range(1, args.repeats + 1):
            t0 = time.perf_counter()
            parts = encode_parts(state)
            t1 = time.perf_counter()
            body_signature(b"s", step, *parts)
            t2 = time.perf_counter()
            source.send_checkpoint([1], step, state, timeout)
            t3 = time.perf_counter()
            got = healer.recv_checkpoint(0, source.metadata(), step, timeout)
            t4 = time.perf_counter()
            assert torch.equal(got["user"]["model"]["w"], state["user"]["model"]["w"])
            encode.append(t1 - t0)
            sign.append(t2 - t1)
            stage.append(t3 - t2)
            fetch.append(t4 - t3)
            del got, parts
    finally:
        source.shutdown()
        healer.shutdown()
    result = {
        "state_mb": args.mb,
        "sha256_mb_s": round(sha256_mb_s),
        "encode_s": statistics.median(encode),
        "sign_s": statistics.median(sign),
        "stage_s": statistics.median(stage),
        "fetch_verify_decode_s": statistics.median(fetch),
        "heal_transfer_s": statistics.median(s + f for s, f in zip(stage, fetch, strict=True)),
        "repeats": args.repeats,
    }
    print(
        f"{args.mb} MB: the survivor stages it in {result['stage_s']:.2f} s (encode {result['encode_s']:.2f} s, "
        f"sign {result['sign_s']:.2f} s), the healer fetches, verifies and decodes it in "
        f"{result['fetch_verify_decode_s']:.2f} s; medians of {args.repeats} (SHA-256 here: {sha256_mb_s:.0f} MB/s)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
