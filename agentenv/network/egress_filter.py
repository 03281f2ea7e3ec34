"""The host-name egress filter: decides a guest's HTTP and HTTPS connections by the name
they are for (the TLS ClientHello's SNI, or the HTTP ``Host`` header) and relays the ones
a sandbox's :class:`~agentenv.network.policy.EgressPolicy` allows.

One asyncio filter serves every sandbox of the server process. For each sandbox whose
policy has host-name rules it listens inside the sandbox's namespace (on
``GUEST_GATEWAY:FILTER_PORT``), where the namespace's ``intercept`` chain redirects the
guest's TCP to :data:`~agentenv.network.egress_rules.FILTERED_PORTS`; the kernel keeps the
original destination (``SO_ORIGINAL_DST``) in the namespace's conntrack.

How a connection is decided, in the policy's order:

1. A name an ``allow_out`` host-name rule matches is allowed. The filter resolves the name
   itself (the host's resolver) and connects to what it resolves to, never to the address
   the guest chose: a guest that sends ``SNI: allowed.example`` to any other server
   reaches ``allowed.example``, not that server. Resolved addresses inside the blocked
   ranges are still refused unless an ``allow_out`` network names them.
2. Otherwise the original destination decides as the ``egress`` chain would for any other
   port (``allow_out`` networks, blocked ranges), except that a ``deny_out`` host-name
   rule matching the name refuses it first.

3. Network ``rules`` (:class:`~agentenv.network.policy.HeaderRule`) then add their headers
   to a plain-HTTP request: a host-name rule only to a connection allowed in step 1 (the
   filter resolved the name itself, so the headers reach that host whatever the guest
   put in ``Host``), a network rule only when the address connected to is in it. Secret
   placeholders are resolved here, on the host, per connection (``secret``); the request
   goes out with ``Connection: close``, so each request of the guest's is a connection of
   its own and gets the headers. A placeholder that does not resolve closes the
   connection. TLS connections are relayed untouched: adding headers to HTTPS would need
   the guest to trust a certificate authority of ours, which it does not.

Connections go out from sockets made inside the sandbox's namespace, so the namespace's
``guard`` chain refuses the blocked ranges again, whatever the filter decided, and the host
masquerades them like the guest's own traffic. A refused connection is closed without a
byte sent. A connection already relayed continues when the policy changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import h11

from agentenv.network.addresses import GUEST_GATEWAY
from agentenv.network.egress_rules import FILTER_PORT, BlockedRanges, decide_address
from agentenv.network.namespaces import call_in_namespace
from agentenv.network.policy import EgressPolicy, HeaderRule, render_header_value

__all__ = [
    "EgressFilter",
    "IncompleteName",
    "Resolver",
    "SecretLookup",
    "Verdict",
    "decide_connection",
    "name_of",
    "read_host_name",
    "resolve_on_host",
    "rewrite_request_head",
    "server_name_of",
]

log = logging.getLogger(__name__)


_SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
_FIRST_BYTES_LIMIT = 16 * 1024  # a ClientHello or request head larger than this is refused
_FIRST_BYTES_TIMEOUT = 10.0
_CONNECT_TIMEOUT = 10.0
_RELAY_CHUNK = 64 * 1024
# Connections one sandbox may have in the filter at once: each holds two sockets in the
# server process, so a guest opening connections in a loop must not exhaust its files.
MAX_CONNECTIONS_PER_SANDBOX = 256


# -- reading the name ------------------------------------------------------------------------


class IncompleteName(Exception):
    """The bytes so far are a prefix of a message that may still name a host."""


def server_name_of(data: bytes) -> str | None:
    """The SNI host name of the TLS ClientHello at the start of `data`; None if `data`
    is a complete ClientHello without one, or not TLS. :class:`IncompleteName` if cut short."""
    if len(data) < 5:
        raise IncompleteName
    if data[0] != 0x16 or data[1] != 0x03:
        return None
    record_length = struct.unpack_from(">H", data, 3)[0]
    body = data[5 : 5 + record_length]
    if len(body) < record_length:
        raise IncompleteName
    # Handshake header: type (1 = ClientHello) and a 3-byte length. A ClientHello split
    # across records is not followed: browsers and TLS libraries send it in one.
    if len(body) < 4 or body[0] != 0x01:
        return None
    pos = 4 + 2 + 32  # handshake header, client version, random
    try:
        pos += 1 + body[pos]  # session id
        pos += 2 + struct.unpack_from(">H", body, pos)[0]  # cipher suites
        pos += 1 + body[pos]  # compression methods
        extensions_end = pos + 2 + struct.unpack_from(">H", body, pos)[0]
        pos += 2
        while pos + 4 <= min(extensions_end, len(body)):
            kind, length = struct.unpack_from(">HH", body, pos)
            pos += 4
            if kind == 0:  # server_name: a list of (type, name); type 0 is a host name
                end = pos + length
                pos += 2
                while pos + 3 <= end:
                    name_type, name_length = body[pos], struct.unpack_from(">H", body, pos + 1)[0]
                    pos += 3
                    if name_type == 0:
                        return body[pos : pos + name_length].decode("ascii")
                    pos += name_length
                return None
            pos += length
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
    return None


def read_host_name(data: bytes) -> str | None:
    """The host name the HTTP/1 request head at the start of `data` is for (its ``Host``
    header, without the port); None if it is not an HTTP request or has no ``Host``.
    :class:`IncompleteName` if the head is not complete yet."""
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=_FIRST_BYTES_LIMIT)
    connection.receive_data(data)
    try:
        event = connection.next_event()
    except h11.RemoteProtocolError:
        return None
    if event is h11.NEED_DATA:
        raise IncompleteName
    if not isinstance(event, h11.Request):
        return None
    for name, value in event.headers:
        if name == b"host":
            host = value.decode("ascii", "replace")
            if host.startswith("["):
                return None  # an IPv6 literal: no name
            return host.rsplit(":", 1)[0] if ":" in host else host
    return None


def name_of(data: bytes) -> str | None:
    """The host name a connection's first bytes are for: SNI if they start a TLS
    handshake, else the HTTP ``Host``. :class:`IncompleteName` if undecided yet."""
    if data[:1] == b"\x16":
        return server_name_of(data)
    return read_host_name(data)


# -- deciding -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """Where a filtered connection goes: to what ``resolve`` resolves to, or to
    ``address`` (the original destination), or nowhere (``allowed`` false)."""

    allowed: bool
    resolve: str | None = None  # connect to what this name resolves to
    address: ipaddress.IPv4Address | None = None  # else to this address


def decide_connection(
    policy: EgressPolicy,
    blocked: BlockedRanges,
    name: str | None,
    destination: ipaddress.IPv4Address,
) -> Verdict:
    """The decision for a connection to `destination` for host name `name` (see the
    module docstring)."""
    if name is not None and any(rule.matches_host(name) for rule in policy.allow_out):
        return Verdict(True, resolve=name)
    named_allow = any(
        rule.network is not None and destination in rule.network for rule in policy.allow_out
    )
    if (
        name is not None
        and not named_allow
        and any(rule.matches_host(name) for rule in policy.deny_out)
    ):
        return Verdict(False)
    if decide_address(policy, blocked, destination):
        return Verdict(True, address=destination)
    return Verdict(False)


# -- rules: adding headers ---------------------------------------------------------------

_HEAD_END = re.compile(rb"\r?\n\r?\n")
# Never the guest's: the filter closes each transformed connection after one request.
_CONNECTION_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-connection"})


class TransformRefused(Exception):
    """A request the rules apply to could not be given its headers."""


def rewrite_request_head(data: bytes, headers: Sequence[tuple[str, str]]) -> bytes | None:
    """`data` (an HTTP/1 request head and what followed it) with `headers` set,
    replacing the guest's of the same names, and ``Connection: close``; None if `data`
    does not start with a complete request head."""
    end = _HEAD_END.search(data)
    if end is None:
        return None
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=_FIRST_BYTES_LIMIT)
    connection.receive_data(data[: end.end()])
    try:
        event = connection.next_event()
    except h11.RemoteProtocolError:
        return None
    if not isinstance(event, h11.Request):
        return None
    replaced = {name.lower().encode() for name, _ in headers} | _CONNECTION_HEADERS
    lines = [b"%s %s HTTP/%s" % (event.method, event.target, event.http_version)]
    lines += [
        name + b": " + value
        for name, value in event.headers.raw_items()
        if name.lower() not in replaced
    ]
    lines += [name.encode() + b": " + value.encode() for name, value in headers]
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + data[end.end() :]


def _rule_applies(
    rule: HeaderRule, verdict: Verdict, name: str | None, address: ipaddress.IPv4Address | None
) -> bool:
    if rule.target.network is not None:
        return address is not None and address in rule.target.network
    return verdict.resolve is not None and name is not None and rule.target.matches_host(name)


#: Gives a secret's value by name (``${e2b.secrets.<name>}`` in a rule's header).
SecretLookup = Callable[[str], Awaitable[str]]


async def _no_secrets(name: str) -> str:
    raise LookupError("this filter has no secrets to resolve placeholders with")


# -- serving -------------------------------------------------------------------------------


def _listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((GUEST_GATEWAY, FILTER_PORT))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _connecting_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock


def _original_destination(sock: socket.socket) -> tuple[ipaddress.IPv4Address, int] | None:
    try:
        raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    except OSError:
        return None
    port = struct.unpack_from(">H", raw, 2)[0]
    address = ipaddress.IPv4Address(raw[4:8])
    return address, port


@dataclass
class _Sandbox:
    """What the filter holds for one sandbox."""

    namespace: str
    policy: EgressPolicy
    blocked: BlockedRanges
    server: asyncio.Server
    connections: set[asyncio.Task[None]] = field(default_factory=set)


Resolver = Callable[[str], Awaitable[list[ipaddress.IPv4Address]]]


async def resolve_on_host(name: str) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses the host's resolver gives for `name`."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        name, None, family=socket.AF_INET, type=socket.SOCK_STREAM
    )
    return [ipaddress.IPv4Address(info[4][0]) for info in infos]


class EgressFilter:
    """The filter for every sandbox of one :class:`NetworkManager`, keyed by slot.
    ``resolve`` turns an allowed host name into the addresses to connect to."""

    def __init__(
        self, resolve: Resolver = resolve_on_host, secret: SecretLookup = _no_secrets
    ) -> None:
        self.resolve = resolve
        self.secret = secret
        self._sandboxes: dict[int, _Sandbox] = {}

    def serving(self, slot: int) -> bool:
        return slot in self._sandboxes

    async def serve(
        self, slot: int, namespace: str, policy: EgressPolicy, blocked: BlockedRanges
    ) -> None:
        """Filter `slot`'s connections by `policy` from now on; starts listening in
        `namespace` if not already (a restarted server listens again)."""
        current = self._sandboxes.get(slot)
        if current is not None and current.namespace == namespace:
            current.policy, current.blocked = policy, blocked
            return
        if current is not None:
            await self.stop(slot)
        sock = await asyncio.to_thread(call_in_namespace, namespace, _listening_socket)
        try:
            server = await asyncio.start_server(
                lambda reader, writer: self._accept(slot, reader, writer), sock=sock
            )
        except BaseException:
            sock.close()
            raise
        self._sandboxes[slot] = _Sandbox(namespace, policy, blocked, server)

    async def stop(self, slot: int) -> None:
        """Stop filtering `slot`: its listener and every connection it relays close (they
        would otherwise keep its namespace alive)."""
        sandbox = self._sandboxes.pop(slot, None)
        if sandbox is None:
            return
        sandbox.server.close()
        for task in list(sandbox.connections):
            task.cancel()
        await asyncio.gather(*sandbox.connections, return_exceptions=True)
        await sandbox.server.wait_closed()

    async def close(self) -> None:
        for slot in list(self._sandboxes):
            await self.stop(slot)

    def _accept(
        self, slot: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sandbox = self._sandboxes.get(slot)
        if sandbox is None or len(sandbox.connections) >= MAX_CONNECTIONS_PER_SANDBOX:
            writer.close()
            return
        task = asyncio.get_running_loop().create_task(self._handle(sandbox, reader, writer))
        sandbox.connections.add(task)
        task.add_done_callback(sandbox.connections.discard)

    async def _handle(
        self, sandbox: _Sandbox, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            sock = writer.get_extra_info("socket")
            original = _original_destination(sock) if sock is not None else None
            if original is None or original[1] == FILTER_PORT:
                return  # reached without the redirect: there is nothing to relay to
            destination, port = original
            first = await asyncio.wait_for(_read_first_bytes(reader), _FIRST_BYTES_TIMEOUT)
            name = _safe_name(first)
            verdict = decide_connection(sandbox.policy, sandbox.blocked, name, destination)
            if not verdict.allowed:
                log.info("%s: refused %s:%d (name %r)", sandbox.namespace, destination, port, name)
                return
            rendered = await self._rendered_rules(sandbox, verdict, name, first)
            upstream_reader, upstream = await self._connect(sandbox, verdict, port)
            upstream.write(self._transformed(rendered, verdict, name, upstream, first))
            await _relay(reader, writer, upstream_reader, upstream)
        except (OSError, asyncio.IncompleteReadError) as exc:  # timeouts are OSErrors
            log.debug("%s: filtered connection ended: %s", sandbox.namespace, exc)
        except TransformRefused as exc:
            log.warning("%s: refused a request to %r: %s", sandbox.namespace, name, exc)
        finally:
            for stream in (writer, upstream):
                if stream is not None:
                    stream.close()

    async def _rendered_rules(
        self, sandbox: _Sandbox, verdict: Verdict, name: str | None, first: bytes
    ) -> list[tuple[HeaderRule, list[tuple[str, str]]]]:
        """The rules that may apply to this connection, their header values resolved
        before anything is sent upstream (a network rule is decided only once the
        address is known: see :meth:`_transformed`)."""
        if not sandbox.policy.header_rules or first[:1] == b"\x16":
            return []  # no rules, or TLS: relayed untouched
        rendered = []
        for rule in sandbox.policy.header_rules:
            if rule.target.network is not None:
                if verdict.address is not None and verdict.address not in rule.target.network:
                    continue
            elif not _rule_applies(rule, verdict, name, None):
                continue
            headers = []
            for header, template in rule.headers:
                try:
                    value = await render_header_value(template, self.secret)
                except Exception as exc:
                    raise TransformRefused(
                        f"header {header!r}: a secret it names is unavailable: {exc}"
                    ) from None
                if any(ch in value for ch in "\r\n\0"):
                    raise TransformRefused(f"header {header!r}: its value has a line break")
                headers.append((header, value))
            rendered.append((rule, headers))
        return rendered

    @staticmethod
    def _transformed(
        rendered: list[tuple[HeaderRule, list[tuple[str, str]]]],
        verdict: Verdict,
        name: str | None,
        upstream: asyncio.StreamWriter,
        first: bytes,
    ) -> bytes:
        """`first` with the headers of the `rendered` rules that apply to the address
        connected to (see the module docstring), or as it is."""
        if not rendered:
            return first
        peer = upstream.get_extra_info("peername")
        address = ipaddress.IPv4Address(peer[0]) if peer else None
        headers: dict[str, tuple[str, str]] = {}
        for rule, values in rendered:
            if _rule_applies(rule, verdict, name, address):
                headers.update((header.lower(), (header, value)) for header, value in values)
        if not headers:
            return first
        rewritten = rewrite_request_head(first, list(headers.values()))
        if rewritten is None:
            raise TransformRefused("not an HTTP/1 request head")
        return rewritten

    async def _connect(
        self, sandbox: _Sandbox, verdict: Verdict, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if verdict.resolve is not None:
            candidates = await self.resolve(verdict.resolve)
            addresses = [a for a in candidates if sandbox.blocked.permits(sandbox.policy, a)]
            if not addresses:
                raise OSError(f"{verdict.resolve} resolves only to blocked addresses")
        else:
            assert verdict.address is not None
            addresses = [verdict.address]
        last: OSError | None = None
        for address in dict.fromkeys(addresses):
            sock = await asyncio.to_thread(call_in_namespace, sandbox.namespace, _connecting_socket)
            try:
                await asyncio.wait_for(
                    asyncio.get_running_loop().sock_connect(sock, (str(address), port)),
                    _CONNECT_TIMEOUT,
                )
                return await asyncio.open_connection(sock=sock)
            except OSError as exc:  # TimeoutError included
                sock.close()
                last = exc
        raise last or OSError("no address to connect to")


def _safe_name(first: bytes) -> str | None:
    try:
        return name_of(first)
    except IncompleteName:
        return None


async def _read_first_bytes(reader: asyncio.StreamReader) -> bytes:
    """The connection's first bytes, up to a complete ClientHello or request head (or
    what came before the peer stopped sending, or the limit)."""
    data = b""
    while len(data) < _FIRST_BYTES_LIMIT:
        chunk = await reader.read(_FIRST_BYTES_LIMIT - len(data))
        if not chunk:
            break
        data += chunk
        try:
            name_of(data)
        except IncompleteName:
            continue
        break
    return data


async def _relay(
    guest_reader: asyncio.StreamReader,
    guest_writer: asyncio.StreamWriter,
    upstream_reader: asyncio.StreamReader,
    upstream_writer: asyncio.StreamWriter,
) -> None:
    async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while chunk := await source.read(_RELAY_CHUNK):
            sink.write(chunk)
            await sink.drain()
        with contextlib.suppress(OSError):
            if sink.can_write_eof():
                sink.write_eof()

    await asyncio.gather(pump(guest_reader, upstream_writer), pump(upstream_reader, guest_writer))
