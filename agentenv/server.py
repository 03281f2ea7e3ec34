"""``aenv-server``: wires a node together (config, VMM driver, orchestrator, API) and
serves it with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import uvicorn
from fastapi import FastAPI

from agentenv import __version__
from agentenv.api.app import create_app
from agentenv.api.http_protocol import JsonErrorsHttpToolsProtocol
from agentenv.config import Config, ConfigError
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.snapshots.objects import RepositoryError, open_store
from agentenv.snapshots.repository import Repository
from agentenv.vmm import confine
from agentenv.vmm.accel import resolve_accelerator
from agentenv.vmm.base import VMMDriver
from agentenv.vmm.cgroups import CgroupError, VmmCgroups, favor_dynamic_moves
from agentenv.vmm.firecracker import FirecrackerDriver
from agentenv.vmm.firecracker_binary import find_firecracker, find_jailer
from agentenv.vmm.launch import RAM_ADVICE_NAME, find_ram_advice, start_vmms_without_huge_pages
from agentenv.vmm.qemu import QemuDriver
from agentenv.vmm.working_set import WorkingSets

log = logging.getLogger("agentenv.server")

#: Seconds an idle keep-alive connection stays open (see ``main``).
KEEP_ALIVE_S = 330

#: Permission bits no file or directory the server makes may give to group or others:
#: state.db holds the sandboxes' records, disk and RAM images hold guests' data.
PRIVATE_UMASK = 0o077


class NodeSetupError(Exception):
    """The node cannot run sandboxes with this configuration on this host."""


@dataclass(frozen=True)
class NodeRuntime:
    driver: VMMDriver
    accel: Literal["tcg", "kvm"]
    #: Why this VMM and accelerator: what ``auto`` found, or that they were set.
    reason: str


def choose_runtime(config: Config) -> NodeRuntime:
    """Pick the VMM and accelerator. ``auto`` prefers Firecracker where hardware KVM
    runs ordinary guests and the binary is installed, else QEMU (KVM or TCG)."""
    probe = resolve_accelerator(config.accel)
    accel_reason = f"accel={config.accel}: {probe.reason}"
    if config.vmm == "firecracker" or (config.vmm == "auto" and probe.accel == "kvm"):
        binary = find_firecracker(config.firecracker)
        if binary is not None and probe.accel == "kvm":
            vmm_reason = vmm_choice_reason(config.vmm, "firecracker", probe.accel)
            return NodeRuntime(
                firecracker_driver(config, binary), "kvm", f"{vmm_reason}; {accel_reason}"
            )
        if config.vmm == "firecracker":
            why = "no Firecracker binary found" if binary is None else probe.reason
            raise NodeSetupError(f"vmm=firecracker is not usable here: {why}")
    vmm_reason = vmm_choice_reason(config.vmm, "qemu", probe.accel)
    advice, working_sets = guest_ram_advice(config)
    driver = QemuDriver(
        tb_size_mib=config.tcg_tb_size_mib,
        confinement=vmm_confinement(config),
        console_limit=config.console_log_bytes,
        ram_advice=advice,
        working_sets=working_sets,
    )
    return NodeRuntime(driver, probe.accel, f"{vmm_reason}; {accel_reason}")


def guest_ram_advice(config: Config) -> tuple[Path | None, WorkingSets | None]:
    """How QEMU maps guest RAM: QEMU's huge-page advice turned into MADV_RANDOM by the
    preloaded library, and the node reading ahead what restored guests touch first
    (``Config.guest_ram_huge_pages``); QEMU's own advice where the library is missing."""
    if config.guest_ram_huge_pages:
        return None, None
    advice = find_ram_advice()
    if advice is None:
        log.warning(
            "%s not found (scripts/install builds it): QEMU keeps its huge-page advice on "
            "guest RAM, and every sandbox caches about 2 MiB of its RAM file per page touched",
            RAM_ADVICE_NAME,
        )
        return None, None
    return advice, WorkingSets(config.working_sets_dir)


def vmm_choice_reason(setting: str, chosen: str, accel: str) -> str:
    """Why ``chosen`` is the VMM under setting ``setting`` with accelerator ``accel``.
    Names no paths: ``/health`` shows it to anyone."""
    if setting != "auto":
        return f"vmm={setting}: set explicitly"
    if chosen == "firecracker":
        return "vmm=auto: hardware KVM and a Firecracker binary, so firecracker"
    if accel != "kvm":
        return "vmm=auto: Firecracker needs hardware KVM, so qemu"
    return "vmm=auto: hardware KVM but no Firecracker binary found, so qemu"


def firecracker_driver(config: Config, binary: Path) -> FirecrackerDriver:
    """The Firecracker driver; with ``confine_vmm`` its VMMs run under the ``jailer``
    beside ``binary`` (:mod:`agentenv.vmm.firecracker_jail`). Raises
    :class:`NodeSetupError` when confinement is on and the jailer is missing."""
    confinement = vmm_confinement(config)
    if confinement is None:
        return FirecrackerDriver(binary, console_limit=config.console_log_bytes)
    jailer = find_jailer(binary)
    if jailer is None:
        raise NodeSetupError(
            f"cannot confine Firecracker VMMs: no jailer next to {binary} or on PATH "
            "(scripts/install-firecracker installs it; confine_vmm = false runs VMMs "
            "unconfined, for development only)"
        )
    return FirecrackerDriver(
        binary, confinement=confinement, jailer=jailer, console_limit=config.console_log_bytes
    )


def vmm_confinement(config: Config) -> confine.Confinement | None:
    """How VMMs are confined on this node, after checking the host has what that needs;
    None with ``confine_vmm`` off. Raises :class:`NodeSetupError` naming what is
    missing."""
    if not config.confine_vmm:
        log.warning("confine_vmm is off: VMMs run as root, unconfined (development only)")
        return None
    parent = f"agentenv-{config.instance_tag}"
    problems = confine.problems(parent)
    if problems:
        raise NodeSetupError(
            "cannot confine VMMs: "
            + "; ".join(problems)
            + " (confine_vmm = false runs them unconfined, for development only)"
        )
    confinement = confine.Confinement(
        data_dir=config.home.resolve(),
        id_base=confine.id_block(config.vmm_id_base, config.instance_tag),
        device_gid=config.vmm_id_base,
        cgroups=VmmCgroups.detect(parent),
        memory_overhead_mib=config.vmm_memory_overhead_mib,
        pids_max=config.vmm_pids_max,
    )
    try:
        confinement.prepare_host()
    except confine.ConfinementError as exc:
        raise NodeSetupError(f"cannot confine VMMs: {exc}") from exc
    if config.cgroup_favordynmods:
        try:
            log.info(
                "%s (VMMs join their cgroups without an RCU grace period)", favor_dynamic_moves()
            )
        except CgroupError as exc:
            log.warning("%s: every VMM start waits 10-20 ms to join its cgroup", exc)
    # Cgroups of VMMs that exited while no server watched them.
    confinement.cgroups.reclaim()
    return confinement


def check_tls(config: Config) -> None:
    """The certificate and key load together: a clear start-up error rather than one from
    inside uvicorn."""
    if config.tls_cert is None or config.tls_key is None:
        return
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise NodeSetupError(
            f"cannot use tls_cert {config.tls_cert} with tls_key {config.tls_key}: {exc}"
        ) from exc


def build_app(config: Config) -> tuple[FastAPI, Orchestrator, str]:
    runtime = choose_runtime(config)
    api_key = config.ensure_api_key()
    orchestrator = Orchestrator(config, runtime.driver, runtime.accel, mode_reason=runtime.reason)
    log.info("vmm %s, accel %s (%s)", runtime.driver.name, runtime.accel, runtime.reason)
    return create_app(orchestrator, api_key), orchestrator, api_key


def banner(config: Config, orchestrator: Orchestrator) -> str:
    url = config.url
    key_hint = (
        "from AENV_API_KEY / the config file"
        if config.api_key
        else f"stored in {config.api_key_path} (mode 0600)"
    )
    key_expr = "$AENV_API_KEY" if config.api_key else f"$(cat {config.api_key_path})"
    runtime = f"vmm {orchestrator.driver.name}, accel {orchestrator.accel}"
    domain_hint = ""
    if config.domain and config.tls_cert is not None:
        domain_hint = (
            f"\nWith a name resolving {config.domain} and *.{config.domain} here, the SDK needs\n"
            f"only: export E2B_DOMAIN={config.domain} E2B_API_KEY={key_expr}\n"
        )
    return f"""
agentenv {__version__} serving on {url}  ({runtime})
data directory: {config.home}
API key: {key_hint}

Try it (the first create waits for the base template to be built):
  export E2B_API_URL={url} E2B_SANDBOX_URL={url} E2B_API_KEY={key_expr}
  curl -s -X POST "$E2B_API_URL/sandboxes" -H "X-API-Key: $E2B_API_KEY" \\
       -H 'Content-Type: application/json' -d '{{"templateID": "base", "timeout": 120}}'
{domain_hint}"""


def collect_garbage(config: Config, grace_s: float) -> None:
    repository = Repository(open_store(config.repository_url, config.s3))
    try:
        blobs, chunks = asyncio.run(repository.collect_garbage(grace_s=grace_s))
    except RepositoryError as exc:
        sys.exit(f"aenv-server: {exc}")
    print(f"{repository.url}: removed {blobs} unreferenced blobs and {chunks} chunks")


def make_data_private(home: Path) -> int:
    """Take group and other permissions off the data directory and what is in it (a data
    directory made by an older server was 0755 with 0644 files). Entries owned by another
    user are left alone: the server gave them away on purpose (a confined VMM's files);
    root's entries in another group (what confined VMMs only read, given to their group)
    keep their group bits and lose only the others'.
    ``oci/`` is tightened but not entered: a guest root tree being built there keeps the
    modes its image gave it. Jail trees of confined VMMs (0711 directories of links, which
    a running VMM traverses) are neither tightened nor entered. Returns how many entries
    changed."""
    changed = 0

    def tighten(path: str, st: os.stat_result) -> None:
        nonlocal changed
        if st.st_uid != os.geteuid():
            return
        strip = 0o077 if st.st_gid == os.getegid() else 0o007
        if st.st_mode & strip:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~strip, follow_symlinks=False)
            changed += 1

    if not home.is_dir():
        return 0
    tighten(str(home), home.stat())
    for root, dirs, files in os.walk(home):
        dirs[:] = [name for name in dirs if not name.startswith(confine.JAIL_PREFIX)]
        if Path(root) == home and "oci" in dirs:
            dirs.remove("oci")
            tighten(str(home / "oci"), (home / "oci").lstat())
        for name in dirs + files:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue  # removed meanwhile (a VMM that outlived the last server)
            if not stat.S_ISLNK(st.st_mode):
                tighten(path, st)
    return changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="aenv-server", description="Run an agentenv node.")
    parser.add_argument("--listen", help="host:port (env AENV_LISTEN, default 127.0.0.1:8000)")
    parser.add_argument("--home", help="data directory (env AENV_HOME, default /var/lib/agentenv)")
    parser.add_argument("--version", action="version", version=f"agentenv {__version__}")
    parser.add_argument(
        "--collect-garbage",
        metavar="GRACE_S",
        type=float,
        help="instead of serving: remove from the repository (AENV_REPOSITORY) what no "
        "snapshot, template or paused sandbox references and is older than GRACE_S "
        "seconds, then exit. Safe while nodes commit (it waits for their pushes).",
    )
    args = parser.parse_args(argv)
    # Before anything is written: every file and directory made from here on (state.db,
    # logs, images, the repository under the data directory) is private to the server.
    os.umask(PRIVATE_UMASK)
    try:
        config = Config.load(listen=args.listen, home=args.home)
    except ConfigError as exc:
        sys.exit(f"aenv-server: configuration error: {exc}")
    if args.collect_garbage is not None:
        collect_garbage(config, args.collect_garbage)
        return
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Per-request and per-connection chatter from libraries drowns the sandbox lifecycle.
    for noisy in ("httpx", "httpcore", "qemu.qmp"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    if os.geteuid() != 0:
        sys.exit("aenv-server: must run as root (it creates network namespaces, taps and VMs)")
    tightened = make_data_private(config.home)
    if tightened:
        log.info("took group/other permissions off %d entries in %s", tightened, config.home)
    # A VMM (oom_score_adj 1000 when confined) is the OOM killer's choice, not the server.
    oom_problem = confine.lower_server_oom_score()
    if oom_problem:
        log.warning("%s (VMMs are still the OOM killer's first choice)", oom_problem)
    try:
        check_tls(config)
        app, orchestrator, _ = build_app(config)
    except (NodeSetupError, ConfigError) as exc:
        sys.exit(f"aenv-server: {exc}")
    if orchestrator.driver.name == QemuDriver.name and orchestrator.accel == "tcg":
        # Before the first VMM starts (the orchestrator starts them once serving).
        thp_problem = start_vmms_without_huge_pages()
        if thp_problem:
            log.warning("%s (TCG's translation cache takes 2 MiB at a time)", thp_problem)
    print(banner(config, orchestrator), flush=True)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level="warning" if config.log_level == "info" else config.log_level,
        timeout_graceful_shutdown=10,
        # Idle keep-alive connections are closed by the client first: the e2b SDK keeps
        # them 300 s (E2B_KEEPALIVE_EXPIRY). A server that closes sooner (uvicorn's
        # default is 5 s) races a client reusing the connection at that moment, which
        # then sees a reset on a request it cannot safely retry, such as a create.
        timeout_keep_alive=KEEP_ALIVE_S,
        # Read request heads up to 1 MiB so the proxy middleware can refuse oversized
        # ones with a 431 body; the protocol would otherwise close the connection
        # mid-upload (JsonErrorsHttpToolsProtocol bounds the head by this setting too).
        h11_max_incomplete_event_size=1024 * 1024,
        http=JsonErrorsHttpToolsProtocol,
        # Not uvloop (which the gateway and scheduler run on): its transports hand out
        # sockets that refuse sendmsg and shutdown, which qemu.qmp's send_fd_scm (pause,
        # snapshot, fork) and the proxy's _shut_down need. Named, since uvicorn's "auto"
        # would pick uvloop once it is installed.
        loop="asyncio",
        ssl_certfile=config.tls_cert,
        ssl_keyfile=config.tls_key,
    )


if __name__ == "__main__":
    main()
