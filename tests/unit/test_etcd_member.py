"""``python -m elastic_train.etcd_member``'s input checks, without an etcd: bad addresses and
clusters, a missing or unusable binary, no member answering. Each names the problem and the fix and
exits 2. (A real cluster under torchrun: tests/launch/test_etcd_rendezvous.py.)"""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_train import etcd_member
from elastic_train.etcd_member import (
    EtcdError,
    Member,
    check_version,
    find_binary,
    main,
    parse_cluster,
    pick,
    split_endpoint,
)

CLUSTER = {"a": "h0:2380", "b": "h1:2380", "c": "h2:2380"}


def fake_etcd(tmp_path: Path, version_line: str) -> Path:
    binary = tmp_path / "etcd"
    binary.write_text(f"#!/bin/sh\necho '{version_line}'\n")
    binary.chmod(0o755)
    return binary


@given(
    names=st.lists(st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True), min_size=1, max_size=5, unique=True),
    port=st.integers(1, 65535),
)
def test_a_cluster_spec_round_trips(names: list[str], port: int) -> None:
    spec = ",".join(f"{n}={n}.example:{port}" for n in names)
    assert parse_cluster(spec) == {n: f"{n}.example:{port}" for n in names}


@pytest.mark.parametrize(
    ("spec", "says"),
    [("", "empty"), ("a", "NAME=HOST:PORT"), ("a=h:1,a=h:2", "twice"), ("a b=h:1", "NAME=HOST:PORT")],
)
def test_a_bad_cluster_spec_is_named(spec: str, says: str) -> None:
    with pytest.raises(EtcdError, match=says):
        parse_cluster(spec)


@pytest.mark.parametrize("value", ["h0", "h0:", ":2379", "h0:port", "h0:0", "h0:70000"])
def test_an_endpoint_must_be_host_and_port(value: str) -> None:
    with pytest.raises(EtcdError, match="is not HOST:PORT"):
        split_endpoint(value, "--client")


def test_the_member_must_be_in_its_cluster_at_its_peer_address() -> None:
    with pytest.raises(EtcdError, match="must list this member as d=h3:2380"):
        Member("d", "h3:2379", "h3:2380", CLUSTER)
    with pytest.raises(EtcdError, match="must list this member as a=h9:2380"):
        Member("a", "h0:2379", "h9:2380", CLUSTER)


def test_an_even_cluster_is_allowed_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    Member("a", "h0:2379", "h0:2380", {"a": "h0:2380", "b": "h1:2380"})
    assert "an odd count" in capsys.readouterr().err


def test_the_command_enables_the_v2_api_and_advertises_the_client_address() -> None:
    command = Member("b", "h1:2379", "h1:2380", CLUSTER).command("etcd", Path("/d"), "job-7")
    assert "--enable-v2=true" in command
    assert command[command.index("--listen-client-urls") + 1] == "http://0.0.0.0:2379"  # etcd binds IPs only
    assert command[command.index("--listen-peer-urls") + 1] == "http://0.0.0.0:2380"
    assert command[command.index("--advertise-client-urls") + 1] == "http://h1:2379"
    assert command[command.index("--initial-cluster") + 1] == "a=http://h0:2380,b=http://h1:2380,c=http://h2:2380"
    assert command[command.index("--initial-cluster-token") + 1] == "job-7"


def test_an_address_is_listened_on_as_given() -> None:
    command = Member("a", "10.0.0.5:2379", "10.0.0.5:2380", {"a": "10.0.0.5:2380"}).command("etcd", Path("/d"), "j")
    assert command[command.index("--listen-client-urls") + 1] == "http://10.0.0.5:2379"
    assert command[command.index("--listen-peer-urls") + 1] == "http://10.0.0.5:2380"


def test_a_missing_binary_names_the_debian_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(etcd_member.BINARY_VAR, raising=False)
    with pytest.raises(EtcdError, match="apt-get install etcd-server"):
        find_binary()
    monkeypatch.setenv(etcd_member.BINARY_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(EtcdError, match="is not an executable"):
        find_binary()


@pytest.mark.parametrize(
    ("line", "ok"),
    [
        ("etcd Version: 3.4.23", True),
        ("etcd Version: 3.5.17", True),
        ("etcd Version: 3.6.0", False),
        ("etcd Version: 2.3.8", False),
        ("something else", False),
    ],
)
def test_only_an_etcd_that_serves_the_v2_api_is_used(tmp_path: Path, line: str, ok: bool) -> None:
    binary = str(fake_etcd(tmp_path, line))
    if ok:
        assert check_version(binary) == line.rsplit(" ", 1)[1]
    else:
        with pytest.raises(EtcdError, match=r"v2 API|no etcd version"):
            check_version(binary)


def test_pick_gives_up_naming_every_endpoint() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: refused at once
        with pytest.raises(EtcdError, match=f"127.0.0.1:{port},127.0.0.1:{port + 0}"):
            pick([f"127.0.0.1:{port}", f"127.0.0.1:{port}"], timeout_s=0.2)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"health":"true"}' if self.path == "/health" else b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def healthy_member() -> Iterator[str]:
    """An HTTP server answering /health as an etcd member with a leader does."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def closed_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again on return: refused at once


def test_pick_skips_a_dead_member_and_every_names_it(healthy_member: str) -> None:
    dead = closed_endpoint()
    assert pick([dead, healthy_member], timeout_s=5) == [healthy_member]
    with pytest.raises(EtcdError, match=f"member\\(s\\) {dead} did not answer") as error:
        pick([healthy_member, dead], timeout_s=0.3, every=True)
    assert healthy_member not in str(error.value)
    assert pick([healthy_member], timeout_s=1, every=True) == [healthy_member]


def test_pick_refuses_an_empty_list_at_once() -> None:
    with pytest.raises(EtcdError, match="no endpoint given"):
        pick([], timeout_s=60)


def test_the_command_exits_2_on_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--name", "a"]) == 2
    assert "missing --client --peer --cluster --data-dir" in capsys.readouterr().err
    assert main(["pick", "nohost"]) == 2
    assert "is not HOST:PORT" in capsys.readouterr().err
    assert main(["pick", ","]) == 2
    assert "no endpoint given" in capsys.readouterr().err
    args = ["--name", "a", "--client", "h0:2379", "--peer", "h0:2380", "--cluster", "b=h1:2380"]
    assert main([*args, "--data-dir", str(tmp_path)]) == 2
    assert "must list this member" in capsys.readouterr().err
