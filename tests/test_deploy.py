"""The deployment files agree with the server: Kubernetes manifests, Dockerfile, proxies.

Nothing here runs Kubernetes or Docker (neither is available in CI): the manifests are
parsed and checked against what the server really answers and accepts (probe paths,
ports, flags, metric names, the drain timeline), and the Dockerfile against the files
it copies. The proxies themselves run in ``test_balancer.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import yaml

from streamer.cli import build_parser
from streamer.server.metrics import Metrics
from streamer.server.server import ServerOptions
from tests.fakes import FakeRecognizer
from tests.server_fixtures import make_server  # noqa: F401  (fixture)
from tests.support import http_get
from tests.timing import timeout_s

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
DOCKERFILE = (REPO / "Dockerfile").read_text()
# measured with the real-size model (bench/RESULTS.md, "Decode path")
# The Deployment's path: the CPU image (the plain install) running a real-size int8 graph
# on ONNX Runtime; its peak resident memory, measured as docs/deploy.md ("Sizing") says
ONNX_INT8_PEAK_BYTES = 425 * 2**20
HEADROOM = 1.25  # limits and requests at least this times the measured peak


def manifests() -> dict[str, dict]:
    """Every Kubernetes object under deploy/k8s, by kind."""
    objects: dict[str, dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "prometheus-adapter-rules.yaml":
            continue  # Helm values, not an object
        for document in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind"} <= document.keys(), path
            assert document["kind"] not in objects, f"two {document['kind']}s"
            objects[document["kind"]] = document
    return objects


OBJECTS = manifests()
DEPLOYMENT = OBJECTS["Deployment"]
POD = DEPLOYMENT["spec"]["template"]["spec"]
CONTAINER = POD["containers"][0]
ENV = {e["name"]: e.get("value") for e in CONTAINER["env"]}


def quantity_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", quantity).groups()
    return int(number) * units[unit]


def serve_flags() -> dict[str, str]:
    """``streamer serve``'s long flags, by their STREAMER_* environment name."""
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = [s for action in serve._actions for s in action.option_strings if s[:2] == "--"]
    return {"STREAMER_" + f[2:].upper().replace("-", "_"): f for f in flags}


def test_every_manifest_parses_and_the_kustomization_lists_files_that_exist() -> None:
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "Kustomization"} <= set(OBJECTS)
    for name in OBJECTS["Kustomization"]["resources"]:
        assert (K8S / name).is_file(), name


def test_container_runs_the_cli_with_real_flags() -> None:
    args = CONTAINER["args"]
    assert args[:1] == ["serve"] and args[args.index("--host") + 1] == "0.0.0.0"
    flags = serve_flags()
    for arg in args[1:]:
        if arg.startswith("--"):
            assert arg in flags.values(), arg
    for name in ENV:
        assert name in flags, f"{name} is no serve flag"


def test_ports_agree_between_server_container_service_and_image() -> None:
    port = int(CONTAINER["args"][CONTAINER["args"].index("--port") + 1])
    (container_port,) = CONTAINER["ports"]
    assert container_port["containerPort"] == port == ServerOptions().port
    annotations = DEPLOYMENT["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port
    service = OBJECTS["Service"]["spec"]
    assert [p["targetPort"] for p in service["ports"]] == [container_port["name"]]
    assert (
        service["selector"].items() <= DEPLOYMENT["spec"]["template"]["metadata"]["labels"].items()
    )
    assert re.search(rf"^EXPOSE {port}$", DOCKERFILE, re.M)
    monitor = OBJECTS["PodMonitor"]["spec"]["podMetricsEndpoints"][0]
    assert monitor["port"] == container_port["name"] and monitor["path"] == "/metrics"


async def test_probe_paths_are_answered_by_the_server(make_server) -> None:  # noqa: F811
    server = make_server(FakeRecognizer, max_sessions=1)
    readiness = CONTAINER["readinessProbe"]["httpGet"]
    liveness = CONTAINER["livenessProbe"]["httpGet"]
    assert readiness["port"] == liveness["port"] == CONTAINER["ports"][0]["name"]
    assert (await asyncio.to_thread(http_get, server.http_url + readiness["path"])).status == 200
    assert (await asyncio.to_thread(http_get, server.http_url + liveness["path"])).status == 200
    assert readiness["path"] == "/readyz" and liveness["path"] == "/healthz"
    # the image's HEALTHCHECK command, run here against the same server: it asks the
    # liveness path on the port of PID 1's command line (--port), else STREAMER_PORT, and
    # fails when nothing answers
    healthcheck = re.search(r"^HEALTHCHECK .*?CMD (\[.*?\])$", DOCKERFILE, re.M | re.S)
    assert healthcheck and liveness["path"] in healthcheck.group(1)
    command = json.loads(healthcheck.group(1))
    assert command[0] == "python" and command[-1] == "/proc/1/cmdline"

    def run_check(cmdline: list[str], env_port: int | None) -> int:
        with tempfile.NamedTemporaryFile("wb", suffix=".cmdline") as proc_cmdline:
            proc_cmdline.write(b"\0".join(arg.encode() for arg in cmdline) + b"\0")
            proc_cmdline.flush()
            env = {k: v for k, v in os.environ.items() if k != "STREAMER_PORT"}
            if env_port is not None:
                env["STREAMER_PORT"] = str(env_port)
            argv = [sys.executable, *command[1:-1], proc_cmdline.name]
            return subprocess.run(
                argv, env=env, capture_output=True, timeout=timeout_s(30)
            ).returncode

    serve = ["/opt/venv/bin/python", "/opt/venv/bin/streamer", "serve", "--host", "0.0.0.0"]
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
        closed = unused.getsockname()[1]
        port = server.port
        assert await asyncio.to_thread(run_check, serve, port) == 0
        assert await asyncio.to_thread(run_check, [*serve, "--port", str(port)], closed) == 0
        assert await asyncio.to_thread(run_check, [*serve, f"--port={port}"], None) == 0
        assert await asyncio.to_thread(run_check, serve, closed) != 0
        assert await asyncio.to_thread(run_check, [*serve, "--port", str(closed)], port) != 0


def test_shutdown_fits_in_the_termination_grace_period() -> None:
    command = CONTAINER["lifecycle"]["preStop"]["exec"]["command"]
    script = command[-1]
    assert "kill -s USR1 1" in script  # the CLI drains on SIGUSR1 (test_readiness.py)
    (sleep_s,) = (float(w) for w in re.findall(r"sleep (\d+(?:\.\d+)?)", script))
    drain_s = float(ENV["STREAMER_DRAIN_S"])
    grace_s = float(ENV["STREAMER_SHUTDOWN_GRACE_S"])
    close_s = ServerOptions().limits.close_timeout_s
    assert POD["terminationGracePeriodSeconds"] > sleep_s + drain_s + grace_s + close_s
    # the balancer notices a drain before it ends: readiness is probed within the drain
    probe = CONTAINER["readinessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] < sleep_s + drain_s


def test_resources_cover_the_measured_memory() -> None:
    resources = CONTAINER["resources"]
    assert quantity_bytes(resources["limits"]["memory"]) >= HEADROOM * ONNX_INT8_PEAK_BYTES
    assert quantity_bytes(resources["requests"]["memory"]) >= HEADROOM * ONNX_INT8_PEAK_BYTES
    # the image serves ONNX Runtime's default model: no torch, no export at start
    assert "STREAMER_MODEL" not in ENV and ENV.get("STREAMER_BACKEND", "auto") != "torch"
    (volume,) = POD["volumes"]
    claim = volume["persistentVolumeClaim"]["claimName"]
    pvc = yaml.safe_load((K8S / "cache-pvc.yaml").read_text())
    assert pvc["metadata"]["name"] == claim and "ReadWriteMany" in pvc["spec"]["accessModes"]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "cache-pvc.yaml" in kustomization["resources"]
    threads = int(ENV["STREAMER_THREADS"])
    assert float(resources["requests"]["cpu"]) >= threads


def test_non_root_user_and_cache_volume_match_the_image() -> None:
    (user,) = re.findall(r"^USER (\d+)$", DOCKERFILE, re.M)
    assert int(user) == POD["securityContext"]["runAsUser"] != 0
    (volume,) = re.findall(r"^VOLUME (\S+)$", DOCKERFILE, re.M)
    assert [m["mountPath"] for m in CONTAINER["volumeMounts"]] == [volume]


def test_autoscaler_targets_the_deployment_with_the_adapters_metric() -> None:
    hpa = OBJECTS["HorizontalPodAutoscaler"]["spec"]
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", DEPLOYMENT["metadata"]["name"])
    (metric,) = hpa["metrics"]
    values = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    # the rule reads gauges the server really exports
    exported = set(re.findall(r"^# TYPE (\w+) ", Metrics().render().decode(), re.M))
    used = set(re.findall(r"\b(streamer_\w+)\{", rule["seriesQuery"] + rule["metricsQuery"]))
    assert used == {"streamer_capacity_utilization"} <= exported
    assert 0 < float(metric["pods"]["target"]["averageValue"].rstrip("m")) / 1000 < 1


def test_the_metrics_the_autoscaler_needs_can_be_scraped_without_the_token() -> None:
    """With STREAMER_TOKEN, /metrics wants it too; the scrapes (annotations, PodMonitor)
    send none, so the sessions metric (and the HPA) would be gone."""
    if "STREAMER_TOKEN" in ENV:
        monitor = yaml.safe_load((K8S / "podmonitor.yaml").read_text())
        authorised = all("authorization" in e for e in monitor["spec"]["podMetricsEndpoints"])
        assert authorised or ENV.get("STREAMER_PUBLIC_METRICS") in ("1", "true")


def test_dockerfile_copies_files_that_exist_and_installs_the_package_pinned() -> None:
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.M):
        for source in sources.split():
            assert (REPO / source).exists(), source
    copied = {s for line in re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.M)
              for s in line.split()}  # fmt: skip
    # everything the package is built from: pyproject.toml, its readme, its packages' folders
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    folders = {p.split(".")[0] for p in setuptools["packages"]} | {
        d.split("/")[0] for d in setuptools["package-dir"].values()
    }
    needed = {"pyproject.toml", project["project"]["readme"], "constraints.txt", *folders}
    assert needed <= copied
    installs = re.findall(r"^RUN pip install (.+)$", DOCKERFILE, re.M)
    assert installs and all("-c /src/constraints.txt" in line for line in installs)
    entry = yaml.safe_load(re.search(r"^ENTRYPOINT (.+)$", DOCKERFILE, re.M).group(1))
    command = yaml.safe_load(re.search(r"^CMD (.+)$", DOCKERFILE, re.M).group(1))
    assert entry == ["streamer"]  # exec form: the server is PID 1 and gets the signals
    assert command[:1] == ["serve"] and command[command.index("--host") + 1] == "0.0.0.0"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".cache", ".git"} <= set(ignored)


def test_proxy_timeouts_outlast_the_servers_idle_timeout() -> None:
    idle_s = ServerOptions().limits.idle_timeout_s
    nginx = (REPO / "deploy" / "nginx.conf").read_text()
    for directive in ("proxy_read_timeout", "proxy_send_timeout", "send_timeout"):
        (value,) = re.findall(rf"^\s*{directive} (\d+)s;", nginx, re.M)
        assert int(value) > 2 * idle_s, directive
    haproxy = (REPO / "deploy" / "haproxy.cfg").read_text()
    for directive in ("timeout tunnel", "timeout client", "timeout server"):
        (value,) = re.findall(rf"^\s*{directive} (\d+)s$", haproxy, re.M)
        assert int(value) > 2 * idle_s, directive
    assert "option httpchk GET /readyz" in haproxy


def test_nginx_upgrades_every_websocket_path() -> None:
    nginx = (REPO / "deploy" / "nginx.conf").read_text()
    root = re.search(r"^    location / \{\n(.*?)^    \}", nginx, re.M | re.S)
    assert root is not None, "one prefix location covers /v1/asr and every other path"
    body = root.group(1)
    for line in ("proxy_pass http://streamer;", "proxy_http_version 1.1;",
                 "proxy_set_header Upgrade $http_upgrade;",
                 "proxy_set_header Connection $connection_upgrade;"):  # fmt: skip
        assert line in body, line
    assert re.search(r"proxy_next_upstream [^;]*http_503", body)
    assert "least_conn;" in nginx


def test_haproxy_runs_unprivileged_with_a_connection_limit_it_can_reach() -> None:
    config = (REPO / "deploy" / "haproxy.cfg").read_text()
    globals_ = config.split("\ndefaults", 1)[0]
    assert re.search(r"^    user haproxy$", globals_, re.M)
    assert re.search(r"^    group haproxy$", globals_, re.M)
    (maxconn,) = (int(v) for v in re.findall(r"^    maxconn (\d+)$", globals_, re.M))
    # HAProxy needs 2 fds per session and sets its own limit as root; stay far below
    # the kernel's default nr_open (1048576) and explain raising it
    assert 1000 <= maxconn <= 10000
