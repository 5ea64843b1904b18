"""Two servers behind a real nginx (deploy/nginx.conf) and HAProxy (deploy/haproxy.cfg).

Everything runs on 127.0.0.1: the balancers are started by the tests with the shipped
configuration files (their upstream addresses, listen port and file paths replaced) and
are skipped when their binary is missing (``scripts/test.sh`` installs both).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from streamer.client.connection import ClientOptions, StreamingClient
from streamer.client.streaming import stream_file, transcribe
from streamer.client.timeline import SessionResult
from streamer.core.protocol import End, Error, Final, SpeechStart, StreamOptions
from streamer.testkit import speech as synth
from tests.fakes import FakeRecognizer, tone
from tests.server_fixtures import ServerThread, make_server, recognizer_loader  # noqa: F401
from tests.support import free_port, on_loop
from tests.timing import eventually, timeout_s

REPO = Path(__file__).resolve().parent.parent
NGINX_CONF = REPO / "deploy" / "nginx.conf"
HAPROXY_CFG = REPO / "deploy" / "haproxy.cfg"
START_GUARD_S = 15


def _binary(name: str) -> str | None:
    # Debian puts both in /usr/sbin, which is not on every user's PATH
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")


NGINX = _binary("nginx")
HAPROXY = _binary("haproxy")
needs_nginx = pytest.mark.skipif(NGINX is None, reason="needs nginx (apt install nginx)")
needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason="needs haproxy (apt install haproxy)")


def _wait_listening(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s(START_GUARD_S)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the balancer exited with {process.returncode}: {log.read_text()}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.02)
    pytest.fail(f"the balancer never listened on {port}")


def _replace_once(text: str, pattern: str, replacement: str, flags: int = 0) -> str:
    """Substitute exactly one match: a changed deploy file fails here, not silently."""
    new, count = re.subn(pattern, replacement, text, flags=flags)
    assert count == 1, f"{pattern!r} matched {count} times"
    return new


def nginx_config(upstream_ports: list[int], listen_port: int) -> str:
    """deploy/nginx.conf with loopback upstreams and listen port (everything else as is)."""
    text = NGINX_CONF.read_text()
    upstream = re.search(r"upstream streamer \{.*?\n\}", text, re.S)
    assert upstream is not None
    lines = re.findall(r"^    server \S+( [^;\n]*);$", upstream.group(0), re.M)
    assert len(lines) >= 2, "the upstream lists its servers with their parameters"
    servers = "".join(f"    server 127.0.0.1:{port}{lines[0]};\n" for port in upstream_ports)
    block = re.sub(r"^    server \S+ [^;\n]*;\n", "", upstream.group(0), flags=re.M)
    block = block.replace("\n}", "\n" + servers + "}")
    text = text.replace(upstream.group(0), block)
    return _replace_once(
        text,
        r"^    listen 80 default_server;$",
        f"    listen 127.0.0.1:{listen_port} default_server;",
        re.M,
    )


@contextlib.contextmanager
def running_nginx(tmp_path: Path, upstream_ports: list[int]) -> Iterator[str]:
    """nginx in the foreground with deploy/nginx.conf; yields its ws:// base URL."""
    assert NGINX is not None
    port = free_port()
    (tmp_path / "streamer.conf").write_text(nginx_config(upstream_ports, port))
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers as root can read tmp_path
    main = f"""{user}worker_processes 1;
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/error.log info;
events {{ worker_connections 512; }}
http {{
    access_log {tmp_path}/access.log;
    client_body_temp_path {tmp_path}/body;
    proxy_temp_path {tmp_path}/proxy;
    fastcgi_temp_path {tmp_path}/fastcgi;
    uwsgi_temp_path {tmp_path}/uwsgi;
    scgi_temp_path {tmp_path}/scgi;
    include {tmp_path}/streamer.conf;
}}
"""
    conf = tmp_path / "nginx.conf"
    conf.write_text(main)
    log = tmp_path / "error.log"
    argv = [NGINX, "-p", str(tmp_path), "-c", str(conf), "-e", str(log)]
    checked = subprocess.run([*argv, "-t"], capture_output=True, text=True, timeout=timeout_s(30))
    assert checked.returncode == 0, checked.stderr
    process = subprocess.Popen([*argv, "-g", "daemon off;"], stdin=subprocess.DEVNULL)
    try:
        _wait_listening(port, process, log)
        yield f"ws://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)  # nginx's fast shutdown
        try:
            process.wait(timeout_s(10))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def haproxy_config(upstream_ports: list[int], listen_port: int, stats: Path) -> str:
    """deploy/haproxy.cfg with loopback servers, bind port and stats socket (else as is)."""
    text = HAPROXY_CFG.read_text()
    shipped = re.search(r"^(    server \S+ \S+( [^\n]*)\n)+", text, re.M)
    assert shipped is not None and shipped.group(0).count("\n") >= 2
    params = shipped.group(2)  # the last server's parameters: all are the same
    ours = "".join(
        f"    server s{i} 127.0.0.1:{port}{params}\n" for i, port in enumerate(upstream_ports)
    )
    text = text.replace(shipped.group(0), ours)
    text = _replace_once(text, r"^    bind :80$", f"    bind 127.0.0.1:{listen_port}", re.M)
    text = _replace_once(text, r"stats socket \S+", f"stats socket {stats}")
    # 2 file descriptors per connection: stay under this machine's limit
    text = _replace_once(text, r"^    maxconn \d+$", "    maxconn 1000", re.M)
    if os.geteuid() != 0:  # only root can change user
        text = _replace_once(text, r"^    user haproxy\n    group haproxy\n", "", re.M)
    # no syslog daemon here: log to stdout, which the test keeps in a file
    return _replace_once(text, r"^    log /dev/log (\w+)$", r"    log stdout format raw \1", re.M)


@contextlib.contextmanager
def running_haproxy(tmp_path: Path, upstream_ports: list[int]) -> Iterator[tuple[str, Path]]:
    """HAProxy in the foreground with deploy/haproxy.cfg; yields its URL and stats socket."""
    assert HAPROXY is not None
    port = free_port()
    stats = tmp_path / "haproxy.sock"
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config(upstream_ports, port, stats))
    checked = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True,
                             timeout=timeout_s(30))  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    log = tmp_path / "haproxy.log"
    with log.open("w") as out:
        process = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        _wait_listening(port, process, log)
        yield f"ws://127.0.0.1:{port}", stats
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s(10))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def haproxy_server_status(stats: Path) -> dict[str, str]:
    """``show stat`` over the stats socket: server name -> UP / DOWN (...).

    Empty while HAProxy has not opened its socket yet (it does so after binding).
    """
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout_s(5))
        try:
            s.connect(str(stats))
        except (FileNotFoundError, ConnectionRefusedError):
            return {}
        s.sendall(b"show stat\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    rows = [line.split(",") for line in data.decode().splitlines() if line and line[0] != "#"]
    return {row[1]: row[17] for row in rows if row[0] == "streamer" and row[1].startswith("s")}


def rejected(server: ServerThread, reason: str) -> float:
    value = server.server.metrics.rejected_total.labels(reason, "v1")._value.get()
    return float(value)


async def _hold_session(url: str) -> StreamingClient:
    return await StreamingClient.connect(ClientOptions(url=url))


# -- nginx: the site file in the distribution's own layout --------------------------------

DEBIAN_NGINX = Path("/etc/nginx")
needs_debian_nginx = pytest.mark.skipif(
    NGINX is None or not (DEBIAN_NGINX / "sites-enabled").is_dir(),
    reason="needs Debian's or Ubuntu's nginx package (/etc/nginx/sites-enabled)",
)


def _documented_steps() -> list[str]:
    """The `sudo` steps of deploy/nginx.conf's header (cp, ln, rm)."""
    steps = re.findall(r"^#   sudo ((?:cp|ln|rm) .+)$", NGINX_CONF.read_text(), re.M)
    assert [step.split()[0] for step in steps] == ["cp", "ln", "rm"], steps
    return steps


def _run_steps(steps: list[str], root: Path, upstream_port: int, listen_port: int) -> None:
    """Run ``steps`` in ``root`` (a copy of /etc), then move the sites' port 80 and
    upstream servers to loopback ports."""
    for step in steps:
        command = step.replace("/etc/nginx", str(root / "nginx"))
        subprocess.run(command, shell=True, check=True, cwd=REPO)
    for site in (root / "nginx" / "sites-available").iterdir():
        text = site.read_text()
        text = re.sub(r"listen 80 ", f"listen 127.0.0.1:{listen_port} ", text)
        text = re.sub(r"^\s*listen \[::\]:80 .*$", "", text, flags=re.M)
        text = re.sub(
            r"^    server \S+:8000 ", f"    server 127.0.0.1:{upstream_port} ", text, flags=re.M
        )
        site.write_text(text)


def _debian_nginx(tmp_path: Path) -> list[str]:
    """The installed /etc/nginx copied to ``tmp_path/etc``, its absolute paths, logs and
    pid moved there; returns the nginx command line that runs it."""
    root = tmp_path / "etc"
    shutil.copytree(DEBIAN_NGINX, root / "nginx", symlinks=True)
    for link in (root / "nginx" / "sites-enabled").iterdir():  # absolute links into /etc
        if link.is_symlink():
            target = os.readlink(link).replace("/etc/nginx", str(root / "nginx"))
            link.unlink()
            link.symlink_to(target)
    main = root / "nginx" / "nginx.conf"
    text = main.read_text().replace("/etc/nginx", str(root / "nginx"))
    text = re.sub(r"^user .*;$", "user root;" if os.geteuid() == 0 else "", text, flags=re.M)
    text = re.sub(r"^pid .*;$", f"pid {tmp_path}/nginx.pid;", text, flags=re.M)
    text = re.sub(r"/var/log/nginx/", f"{tmp_path}/", text)
    temp = "".join(f"    {kind}_temp_path {tmp_path}/{kind};\n"
                   for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))  # fmt: skip
    text = text.replace("http {\n", "http {\n" + temp, 1)
    main.write_text(text)
    return [NGINX, "-p", str(tmp_path), "-c", str(main), "-e", str(tmp_path / "error.log")]


@needs_debian_nginx
async def test_the_site_file_works_in_the_distributions_nginx(make_server, tmp_path: Path) -> None:  # noqa: F811
    server = make_server(FakeRecognizer, max_sessions=2)
    port = free_port()
    argv = _debian_nginx(tmp_path)
    cp, ln, rm = _documented_steps()
    # without the last step, Debian's own site is a second default server on the port
    _run_steps([cp, ln], tmp_path / "etc", server.port, port)
    both = subprocess.run([*argv, "-t"], capture_output=True, text=True, timeout=timeout_s(30))
    assert both.returncode != 0 and "duplicate default server" in both.stderr
    _run_steps([rm], tmp_path / "etc", server.port, port)
    checked = subprocess.run([*argv, "-t"], capture_output=True, text=True, timeout=timeout_s(30))
    assert checked.returncode == 0, checked.stderr
    process = subprocess.Popen([*argv, "-g", "daemon off;"], stdin=subprocess.DEVNULL)
    try:
        _wait_listening(port, process, tmp_path / "error.log")

        def page(host: str) -> str:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/", headers={"Host": host})
            with urllib.request.urlopen(request, timeout=timeout_s(10)) as response:
                return response.read().decode()

        for host in ("asr.example.com", "localhost"):
            body = await asyncio.to_thread(page, host)
            assert "<title>SenseVoice live captions</title>" in body, host
            assert "Welcome to nginx" not in body
        session = await _hold_session(f"ws://127.0.0.1:{port}/v1/asr")  # the upgrade passes
        assert session.ready.session_id
        await session.close()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout_s(10))


# -- nginx: a refused handshake is retried on the other server ----------------------------


@needs_nginx
@pytest.mark.parametrize("state", ["full", "draining"])
async def test_nginx_sends_new_sessions_past_a_full_or_draining_server(
    make_fake_server, tmp_path, state
):
    a = make_fake_server(max_sessions=1 if state == "full" else 64)
    b = make_fake_server()
    held = await _hold_session(a.url)  # directly: nginx does not count it
    if state == "draining":
        on_loop(a, a.server.start_draining)
    with running_nginx(tmp_path, [a.port, b.port]) as base:
        # least_conn sends one of the first two handshakes to `a` (nginx counts none open
        # there); `a` answers 503 and nginx retries `b`: the client sees no refusal
        clients = [await _hold_session(base + "/v1/asr") for _ in range(4)]
        assert b.server.session_count == 4 and a.server.session_count == 1
        assert rejected(a, "server_full" if state == "full" else "draining") >= 1
        for client in clients:
            await client.close()
    await held.close()


@needs_nginx
def test_nginx_passes_uploads_larger_than_its_default_limit(make_fake_server, tmp_path) -> None:
    # larger than nginx's default client_max_body_size (1 MB): deploy/nginx.conf raises it
    server = make_fake_server()
    pcm = np.concatenate([np.zeros(8000, np.int16), tone(600), np.zeros(16000 * 40, np.int16)])
    with running_nginx(tmp_path, [server.port]) as base:
        port = int(base.rsplit(":", 1)[1])
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s(30))
        connection.request(
            "POST", "/v1/listen?encoding=linear16&sample_rate=16000", body=pcm.tobytes()
        )
        response = connection.getresponse()
        body = orjson.loads(response.read())
        connection.close()
    assert response.status == 200, body
    assert body["results"]["channels"][0]["alternatives"][0]["transcript"].startswith("audio")


# -- nginx: 20 clients, one server shut down mid-stream ----------------------------------


def _segments(messages) -> tuple[set[int], set[int]]:
    started = {m.segment_id for m in messages if isinstance(m, SpeechStart)}
    finished = {m.segment_id for m in messages if isinstance(m, Final)}
    return started, finished


def _raw(finals) -> list[str]:
    return [f.raw for f in finals]


def _key(finals) -> list[tuple]:
    """What a final says (not how long it took)."""
    return [(f.segment_id, f.start_ms, f.end_ms, f.raw, f.reason) for f in finals]


def _check_moved_session(result: SessionResult, resumed_at: int, baseline: list[Final]) -> None:
    """A session of the server that shut down: it finished, then resumed with nothing lost."""
    messages = [r.message for r in result.messages]
    first_end = next(i for i, m in enumerate(messages) if isinstance(m, End))
    first, second = messages[: first_end + 1], messages[first_end + 1 :]
    # the shut-down server's session: a notice, a final for every open segment, then `end`
    assert any(isinstance(m, Error) and m.code == "server_shutdown" for m in first)
    started, finished = _segments(first)
    assert started == finished, "a segment the server started got no final"
    cut_ms = resumed_at / 16
    finals_1 = [m for m in first if isinstance(m, Final)]
    finals_2 = [m for m in second if isinstance(m, Final)]
    # resumed exactly where the last final ended: no audio skipped, none decoded twice
    assert finals_1 and cut_ms == pytest.approx(finals_1[-1].end_ms, abs=0.1)
    assert all(f.start_ms >= cut_ms - 0.1 for f in finals_2)
    # the transcript against the run without a shutdown: the utterances finished before
    # the cut are the baseline's, exactly; one the shutdown cut short is finished with
    # reason "stop" (it may be split in two if speech went on past the cut); every
    # utterance after the cut is the baseline's, decoded by the other server
    cut = finals_1[-1] if finals_1[-1].reason == "stop" else None
    kept = finals_1[:-1] if cut is not None else finals_1
    n = len(kept)
    assert _key(kept) == _key(baseline[:n])
    rest = baseline[n:]
    if cut is not None:
        assert cut.start_ms == baseline[n].start_ms  # the same utterance, cut short
        rest = baseline[n + 1 :]
        if baseline[n].end_ms > cut_ms and len(finals_2) > len(rest):
            finals_2 = finals_2[1:]  # its remainder, decoded on its own
    assert [(f.raw, f.reason) for f in finals_2] == [(f.raw, f.reason) for f in rest]
    for got, expected in zip(finals_2, rest, strict=True):
        assert got.start_ms == pytest.approx(expected.start_ms, abs=100)
        assert got.end_ms == pytest.approx(expected.end_ms, abs=100)


@needs_nginx
@pytest.mark.skipif(not synth.tools_available(), reason="needs espeak-ng and sox")
async def test_nginx_twenty_clients_one_server_shut_down_mid_stream(
    make_server,  # noqa: F811
    tagged_model_dir,
    speech_cache,
    tmp_path,
    caplog,
):
    load = recognizer_loader(tagged_model_dir)
    a = make_server(load, drain_s=2.0, lifecycle=True)  # run(): stopped as by SIGTERM
    b = make_server(load)
    fox = synth.speak("the quick brown fox jumps over the lazy dog", "en", cache_dir=speech_cache)
    hello = synth.speak("hello there", "en", cache_dir=speech_cache)
    clips = [("en", "fox", fox), ("en", "hello", hello)] * 3  # 18 s
    pcm, _ = synth.join_with_silence(clips, 1000)
    stream = StreamOptions(itn=False)
    # the run without a shutdown: finals depend on the audio only, not on pacing
    baseline = list((await transcribe(ClientOptions(url=b.url, stream=stream), pcm, 16000)).finals)
    assert len(baseline) == 6 and baseline[1].text == "hello there"

    caplog.set_level(logging.INFO, logger="streamer.client")
    with running_nginx(tmp_path, [a.port, b.port]) as base:
        options = ClientOptions(url=base + "/v1/asr", stream=stream, initial_backoff_s=0.05)
        resumed_at: dict[int, int] = {}

        def on_reconnect(client: int):
            return lambda count, sample, error: resumed_at.setdefault(client, sample)

        async def client(i: int) -> SessionResult:
            await asyncio.sleep(i * 0.1)  # staggered: the shutdown cuts each at another point
            return await stream_file(options, pcm, sample_rate=16000, speed=2.0,
                                     on_reconnect=on_reconnect(i))  # fmt: skip

        runs = [asyncio.create_task(client(i)) for i in range(20)]
        await eventually(lambda: a.server.session_count + b.server.session_count == 20)
        on_a, on_b = a.server.session_count, b.server.session_count
        assert abs(on_a - on_b) <= 2, (on_a, on_b)  # least_conn spreads them

        # SIGTERM on `a` (run()'s own sequence): drain (new sessions refused, open ones
        # served), then the graceful shutdown (open segments finished, `end`, close 1001)
        a.request_stop()
        await eventually(lambda: a.server.draining)
        late = [await StreamingClient.connect(options) for _ in range(2)]  # one attempt each
        assert b.server.session_count == on_b + 2 and a.server.session_count == on_a
        for client in late:
            await client.close()
        assert await asyncio.to_thread(a.join, 30), "a's run() did not return"
        assert a.exit_status == 0
        results = await asyncio.wait_for(asyncio.gather(*runs), timeout_s(60))
    # a and b were identical: the first on_a sessions were a's, and a's only
    assert len(resumed_at) == on_a
    for i, result in enumerate(results):
        assert result.end is not None and result.end.segments == len(result.finals)
        if i in resumed_at:
            assert result.reconnects == 1
            _check_moved_session(result, resumed_at[i], baseline)
        else:  # never moved: exactly the run without a shutdown
            assert result.reconnects == 0
            assert _key(result.finals) == _key(baseline)
    # nginx retried every refused handshake itself: no client ever saw one
    assert not [r for r in caplog.records if "connect attempt" in r.getMessage()]


# -- HAProxy: active /readyz checks ---------------------------------------------------------


@needs_haproxy
@pytest.mark.parametrize("state", ["full", "draining"])
async def test_haproxy_takes_a_full_or_draining_server_out_and_back(
    make_fake_server, tmp_path, state
):
    a = make_fake_server(max_sessions=1 if state == "full" else 64)
    b = make_fake_server()
    with running_haproxy(tmp_path, [a.port, b.port]) as (base, stats):
        await eventually(lambda: set(haproxy_server_status(stats).values()) == {"UP"}, 20)
        held = await _hold_session(a.url)  # directly: fills `a`, or goes on while it drains
        if state == "draining":
            on_loop(a, a.server.start_draining)
        await eventually(lambda: haproxy_server_status(stats).get("s0", "").startswith("DOWN"), 20)
        assert haproxy_server_status(stats)["s1"] == "UP"
        # out of rotation: no handshake reaches `a` at all, every new session goes to b
        clients = [await _hold_session(base + "/v1/asr") for _ in range(4)]
        assert b.server.session_count == 4 and a.server.session_count == 1
        assert rejected(a, "server_full") == rejected(a, "draining") == 0
        # the session on `a` went on meanwhile and ends normally
        await held.send_audio(np.zeros(1600, dtype=np.int16))
        await held.stop()
        async for _ in held.messages():
            pass
        assert held.end is not None
        if state == "draining":
            on_loop(a, a.server.stop_draining)
        await eventually(lambda: haproxy_server_status(stats).get("s0") == "UP", 20)
        back = await _hold_session(base + "/v1/asr")  # least connections: `a` again
        assert a.server.session_count == 1
        for client in [*clients, back]:
            await client.close()
