"""A cluster on one machine, in one command: Redis, the scheduler, the gateway and N
nodes, each node with its own data directory, all sharing a ``file://`` repository,
the API key and the envd token key (``scripts/cluster up --nodes 3``). The processes
outlive the command; their ids are kept in ``cluster.json`` under the cluster's directory,
which ``down`` reads to stop them (it kills the nodes' sandboxes first: their VMMs
outlive a node by design).

Variants: ``--schedulers N`` runs N scheduler replicas against the one Redis (nodes and
the gateway are given all their URLs); ``--tls`` makes a throw-away CA (``local_ca``)
and has every component serve HTTPS with its certificate (for ``aenv.localhost``,
``*.aenv.localhost`` and 127.0.0.1) and verify the others with the CA, so clients use
``E2B_DOMAIN`` alone.

The tests start their clusters with :class:`LocalCluster` too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from agentenv.cluster.local_ca import make_local_ca
from agentenv.cluster.tls import client_context

ROOT = Path(__file__).resolve().parents[2]
STATE_FILE = "cluster.json"
# The domain of a --tls cluster: *.localhost names resolve to the loopback address without
# DNS in the SDK's resolver, and a wildcard certificate needs a label under it.
TLS_DOMAIN = "aenv.localhost"


class ClusterStartError(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: str
    pid: int | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )
        self.pid = proc.pid

    def alive(self) -> bool:
        if self.pid is None:
            return False
        try:
            waited, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            waited = 0  # not our child (started by another command): ask the kernel
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            return True
        return waited == 0

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            while self.alive():
                time.sleep(0.05)
        self.pid = None

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(Path(self.log).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalCluster:
    root: Path
    nodes: int = 2
    api_key: str = field(default_factory=lambda: "e2b_" + secrets.token_hex(20))
    gateway_port: int = field(default_factory=free_port)
    scheduler_port: int = field(default_factory=free_port)
    redis_port: int = field(default_factory=free_port)
    # Scheduler replicas, all on the one Redis; the first listens on scheduler_port.
    schedulers: int = 1
    extra_scheduler_ports: list[int] = field(default_factory=list)
    # Every component serves HTTPS with a certificate of a CA made under root/tls.
    tls: bool = False
    heartbeat_interval: float = 1.0
    node_timeout: float = 5.0
    # The scheduler's --overcommit (how far allocations may exceed a node's CPUs/memory).
    overcommit: float = 4.0
    # Extra AENV_* settings for every node (e.g. a short network linger in tests).
    node_env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, Proc] = field(default_factory=dict)

    # -- addresses -----------------------------------------------------------------------
    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def ca_file(self) -> Path | None:
        """The CA a --tls cluster's certificates are signed by (what clients trust)."""
        return self.root / "tls" / "ca.pem" if self.tls else None

    def verify(self) -> bool | ssl.SSLContext:
        """What a client of this cluster's components verifies them with."""
        return client_context(self.ca_file) if self.tls else True

    @property
    def domain(self) -> str:
        """The gateway's (and nodes') domain: ``{port}-{id}.{domain}`` reaches a sandbox."""
        host = TLS_DOMAIN if self.tls else "localhost"
        return f"{host}:{self.gateway_port}"

    @property
    def gateway_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.gateway_port}"

    def scheduler_name(self, index: int) -> str:
        return "scheduler" if index == 0 else f"scheduler-{index}"

    @property
    def scheduler_urls(self) -> list[str]:
        """Every replica's URL, the first's first."""
        ports = [self.scheduler_port, *self.extra_scheduler_ports]
        return [f"{self.scheme}://127.0.0.1:{port}" for port in ports]

    @property
    def scheduler_url(self) -> str:
        """The first replica's URL."""
        return self.scheduler_urls[0]

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def node_name(self, index: int) -> str:
        return f"node-{index}"

    def client_env(self) -> dict[str, str]:
        """What a client exports to use the cluster with the e2b SDK or ``aenv``."""
        if self.tls:
            return {
                "E2B_DOMAIN": self.domain,
                "E2B_API_KEY": self.api_key,
                "SSL_CERT_FILE": str(self.ca_file),
                "AENV_SERVER": self.gateway_url,
                "AENV_API_KEY": self.api_key,
            }
        return {
            "E2B_API_URL": self.gateway_url,
            "E2B_SANDBOX_URL": self.gateway_url,
            "E2B_API_KEY": self.api_key,
            "AENV_SERVER": self.gateway_url,
            "AENV_API_KEY": self.api_key,
        }

    # -- processes -----------------------------------------------------------------------
    def _plan(self) -> None:
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        base["AENV_API_KEY"] = self.api_key
        tls: dict[str, str] = {}
        if self.tls:
            # Valid for 30 days: a local cluster may be left running for a while.
            ca = make_local_ca(self.root / "tls", TLS_DOMAIN, days=30)
            tls = {
                "AENV_TLS_CERT": str(ca.server_cert.resolve()),
                "AENV_TLS_KEY": str(ca.server_key.resolve()),
                "AENV_CA_FILE": str(ca.ca_cert.resolve()),
            }
        python = sys.executable
        redis_dir = self.root / "redis"
        redis_dir.mkdir(exist_ok=True)
        redis_server = shutil.which("redis-server")
        if redis_server is None:
            raise ClusterStartError("redis-server is not installed (scripts/install installs it)")
        self.procs["redis"] = Proc(
            "redis",
            [
                redis_server,
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(redis_dir),
                "--appendonly",
                "yes",
                "--save",
                "",
            ],
            base,
            str(logs / "redis.log"),
        )
        while len(self.extra_scheduler_ports) < self.schedulers - 1:
            self.extra_scheduler_ports.append(free_port())
        for index, url in enumerate(self.scheduler_urls):
            name = self.scheduler_name(index)
            self.procs[name] = Proc(
                name,
                [
                    python,
                    "-m",
                    "agentenv.cluster.scheduler",
                    "--listen",
                    url.split("://", 1)[1],
                    "--redis",
                    self.redis_url,
                    "--node-timeout",
                    str(self.node_timeout),
                    "--overcommit",
                    str(self.overcommit),
                ],
                {**base, **tls},
                str(logs / f"{name}.log"),
            )
        domain = self.domain
        schedulers = ",".join(self.scheduler_urls)
        self.procs["gateway"] = Proc(
            "gateway",
            [
                python,
                "-m",
                "agentenv.cluster.gateway_main",
                "--listen",
                f"127.0.0.1:{self.gateway_port}",
                "--scheduler",
                schedulers,
                "--domain",
                domain,
            ],
            {**base, **tls},
            str(logs / "gateway.log"),
        )
        token_key = secrets.token_hex(32)
        repository = (self.root / "repository").resolve()
        repository.mkdir(exist_ok=True)
        for index in range(self.nodes):
            name = self.node_name(index)
            env = {
                **base,
                "AENV_HOME": str((self.root / name).resolve()),
                "AENV_LISTEN": f"127.0.0.1:{free_port()}",
                "AENV_NODE_ID": name,
                "AENV_REPOSITORY": repository.as_uri(),
                "AENV_ENVD_TOKEN_KEY": token_key,
                "AENV_SCHEDULER_URL": schedulers,
                "AENV_HEARTBEAT_INTERVAL": str(self.heartbeat_interval),
                "AENV_DOMAIN": domain,
                **tls,
                **self.node_env,
            }
            self.procs[name] = Proc(
                name, [python, "-m", "agentenv.server"], env, str(logs / f"{name}.log")
            )

    def up(self, wait: float = 900.0) -> None:
        """Start everything and wait until every node is ready (its base template built)
        and up in the scheduler. On failure, what started is stopped again."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._plan()
        try:
            for proc in self.procs.values():
                proc.start()
                if proc.name == "redis":
                    self._wait_for_port(self.redis_port, proc)
            self.save()
            self._wait_ready(wait)
        except BaseException:
            self.down()
            raise

    def _wait_ready(self, wait: float, names: set[str] | None = None) -> None:
        """Wait for the processes ``names`` (default: all) to serve, and for the nodes
        among them to be up in the scheduler."""
        deadline = time.monotonic() + wait
        # With the key: without it a node's /health says nothing of its templates.
        with httpx.Client(
            trust_env=False,
            timeout=5,
            verify=self.verify(),
            headers={"X-API-Key": self.api_key},
        ) as http:
            for name, proc in self.procs.items():
                if name == "redis" or not proc.alive() or (names and name not in names):
                    continue
                url = self.url_of(name)
                while not self._ready(http, name, url):
                    if not proc.alive():
                        raise ClusterStartError(f"{name} exited:\n{proc.tail()}")
                    if time.monotonic() > deadline:
                        raise ClusterStartError(f"{name} not ready in {wait}s:\n{proc.tail()}")
                    time.sleep(0.3)
            nodes = {
                name
                for name, proc in self.procs.items()
                if name.startswith("node-") and proc.alive() and (not names or name in names)
            }
            # Up, and holding the base template as their heartbeats say: placement
            # prefers nodes that hold a template, so a create right after the start
            # would otherwise go to whichever node's heartbeat said so first.
            while not nodes <= set(self.nodes_up(http, holding="base")):
                if time.monotonic() > deadline:
                    raise ClusterStartError("nodes did not all register with the scheduler")
                time.sleep(0.3)

    def url_of(self, name: str) -> str:
        """Where the process ``name`` serves (a node, a scheduler, the gateway)."""
        if name == "gateway":
            return self.gateway_url
        argv = self.procs[name].argv
        if "--listen" in argv:
            return f"{self.scheme}://{argv[argv.index('--listen') + 1]}"
        return f"{self.scheme}://{self.procs[name].env['AENV_LISTEN']}"

    @staticmethod
    def _wait_for_port(port: int, proc: Proc, wait: float = 30.0) -> None:
        deadline = time.monotonic() + wait
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return
            if not proc.alive() or time.monotonic() > deadline:
                raise ClusterStartError(f"{proc.name} is not listening on {port}:\n{proc.tail()}")
            time.sleep(0.05)

    @staticmethod
    def _ready(http: httpx.Client, name: str, url: str) -> bool:
        try:
            response = http.get(f"{url}/health")
        except httpx.HTTPError:
            return False
        if not name.startswith("node-"):
            return response.status_code in (200, 503)
        try:
            state = response.json()["templates"].get("base")
        except (ValueError, KeyError):
            return False
        if state == "failed":
            raise ClusterStartError(
                f"{name}: base template failed: {response.json().get('detail')}"
            )
        return bool(state == "ready")

    def nodes_up(self, http: httpx.Client, *, holding: str | None = None) -> list[str]:
        """The nodes the scheduler has up (and, with ``holding``, that report holding
        that template)."""
        try:
            nodes = http.get(f"{self.scheduler_url}/nodes", headers={"X-API-Key": self.api_key})
            return [
                n["report"]["nodeID"]
                for n in nodes.json()
                if n["state"] == "up" and (holding is None or holding in n["report"]["templates"])
            ]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return []

    def restart(self, name: str, wait: float = 60.0) -> None:
        """Stop the process ``name`` (``scheduler``, ``gateway``, ...) and start it again."""
        proc = self.procs[name]
        proc.stop()
        proc.start()
        self.save()
        self._wait_ready(wait, names={name})

    def kill_sandboxes(self) -> None:
        """Kill every sandbox on every node that still answers (their VMMs would
        otherwise outlive the nodes)."""
        with httpx.Client(
            trust_env=False,
            timeout=60,
            headers={"X-API-Key": self.api_key},
            verify=self.verify(),
        ) as http:
            for name, proc in self.procs.items():
                if not name.startswith("node-") or not proc.alive():
                    continue
                url = self.url_of(name)
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    for item in http.get(f"{url}/sandboxes").json():
                        http.delete(f"{url}/sandboxes/{item['sandboxID']}")

    def down(self) -> None:
        self.kill_sandboxes()
        # Nodes first (they heartbeat to the scheduler), Redis last.
        for name in sorted(self.procs, key=lambda n: (not n.startswith("node-"), n == "redis")):
            self.procs[name].stop()
        self.save()

    # -- the state file ------------------------------------------------------------------
    def save(self) -> None:
        data = {
            "nodes": self.nodes,
            "api_key": self.api_key,
            "gateway_port": self.gateway_port,
            "scheduler_port": self.scheduler_port,
            "redis_port": self.redis_port,
            "extra_scheduler_ports": self.extra_scheduler_ports,
            "tls": self.tls,
            "procs": {name: asdict(proc) for name, proc in self.procs.items()},
        }
        path = self.root / STATE_FILE
        path.write_text(json.dumps(data, indent=2))
        path.chmod(0o600)

    @classmethod
    def load(cls, root: Path) -> LocalCluster:
        data = json.loads((root / STATE_FILE).read_text())
        cluster = cls(
            root=root,
            nodes=data["nodes"],
            api_key=data["api_key"],
            gateway_port=data["gateway_port"],
            scheduler_port=data["scheduler_port"],
            redis_port=data["redis_port"],
            schedulers=1 + len(data.get("extra_scheduler_ports", [])),
            extra_scheduler_ports=data.get("extra_scheduler_ports", []),
            tls=data.get("tls", False),
        )
        cluster.procs = {name: Proc(**proc) for name, proc in data["procs"].items()}
        return cluster


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cluster", description="A local agentenv cluster.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start Redis, scheduler, gateway and N nodes")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--port", type=int, default=8080, help="the gateway's port (8080)")
    up.add_argument(
        "--schedulers", type=int, default=1, help="scheduler replicas on the one Redis (1)"
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="every component serves HTTPS with a certificate of a throw-away CA",
    )
    down = sub.add_parser("down", help="stop what `up` started")
    for command in (up, down):
        command.add_argument(
            "--dir", type=Path, default=Path("/var/tmp/agentenv-cluster"), help="state and data"
        )
    args = parser.parse_args(argv)
    if args.command == "down":
        if not (args.dir / STATE_FILE).exists():
            sys.exit(f"cluster: no cluster in {args.dir}")
        LocalCluster.load(args.dir).down()
        print(f"cluster in {args.dir} stopped")
        return
    if (args.dir / STATE_FILE).exists():
        existing = LocalCluster.load(args.dir)
        if any(proc.alive() for proc in existing.procs.values()):
            sys.exit(f"cluster: one is running in {args.dir}; `cluster down --dir {args.dir}`")
    if args.nodes < 1 or args.schedulers < 1:
        sys.exit("cluster: --nodes and --schedulers must be at least 1")
    cluster = LocalCluster(
        args.dir, nodes=args.nodes, gateway_port=args.port, schedulers=args.schedulers, tls=args.tls
    )
    try:
        cluster.up()
    except ClusterStartError as exc:
        sys.exit(f"cluster: {exc}")
    schedulers = ", ".join(cluster.scheduler_urls)
    print(f"{args.nodes} nodes, scheduler(s) {schedulers}, Redis {cluster.redis_url}")
    if cluster.tls:
        print(f"TLS: certificates signed by {cluster.ca_file} (SSL_CERT_FILE below trusts it)")
    print(f"logs in {args.dir / 'logs'}; stop with: scripts/cluster down --dir {args.dir}\n")
    for key, value in cluster.client_env().items():
        print(f"export {key}={value}")


if __name__ == "__main__":
    main()
