"""A rendezvous store that outlives any training node: ``python -m elastic_train.rendezvous``.

torchrun's c10d rendezvous keeps its state in a ``TCPStore``. By default the agent at
``--rdzv-endpoint`` hosts it, so losing that node ends the whole job
("RendezvousConnectionError: The connection to the C10d store has failed"). This process serves
the store instead, on the batch host (or any machine that is not a training node), and every
agent joins it as a client:

    python -m elastic_train.rendezvous --port 29400 &          # on the batch host
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:4 --nproc-per-node=4 \\
        --rdzv-backend=c10d --rdzv-endpoint=BATCHHOST:29400 --rdzv-id=$SLURM_JOB_ID \\
        --rdzv-conf is_host=false,join_timeout=600,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3 \\
        --max-restarts=3 -m elastic_train ...

It is torch's own ``TCPStore`` server, nothing home-made: the rendezvous protocol is untouched.
It runs until SIGTERM or SIGINT, and prints ``rendezvous store ready on HOST:PORT`` once it
accepts connections (``--ready-file`` also writes that line to a file, for scripts).
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType


def serve(host: str, port: int, ready_file: Path | None, stop: threading.Event) -> int:
    import torch.distributed as dist

    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
        )
    except Exception as exc:  # a port in use, a bad address: say which and exit non-zero
        print(f"elastic-train rendezvous: cannot serve on {host}:{port}: {exc}", file=sys.stderr, flush=True)
        return 1
    line = f"rendezvous store ready on {host}:{store.port}"
    print(line, flush=True)
    if ready_file is not None:
        ready_file.write_text(line + "\n")
    stop.wait()
    del store
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_train.rendezvous", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument("--port", type=int, default=29400)
    parser.add_argument("--ready-file", type=Path, default=None)
    args = parser.parse_args(argv)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return serve(args.host, args.port, args.ready_file, stop)


if __name__ == "__main__":
    sys.exit(main())
