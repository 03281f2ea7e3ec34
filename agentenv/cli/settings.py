"""Where aenv finds its server and API key: ``AENV_SERVER`` / ``AENV_API_KEY`` in the
environment override ``$XDG_CONFIG_HOME/aenv/config.toml`` (``~/.config/aenv/...``),
which ``aenv auth`` writes with mode 0600."""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from agentenv.cli.errors import CliError, ExitCode

DEFAULT_SERVER = "http://127.0.0.1:8000"
SERVER_ENV = "AENV_SERVER"
API_KEY_ENV = "AENV_API_KEY"


@dataclass(frozen=True)
class Settings:
    server: str
    api_key: str | None
    # Where each value came from ("env", "file" or "default"), for `aenv auth --show`.
    server_source: str
    api_key_source: str

    def require_api_key(self) -> str:
        if not self.api_key:
            raise CliError(
                f"no API key configured: run `aenv auth` or set {API_KEY_ENV} "
                "(the server keeps its key in $AENV_HOME/api_key)",
                ExitCode.AUTH,
            )
        return self.api_key


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "aenv" / "config.toml"


def normalize_server(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        # "host:port" is what people type; the API is plain HTTP unless told otherwise.
        url = f"http://{url}"
    return url


def read_config_file(path: Path | None = None) -> dict[str, str]:
    path = path or config_path()
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from exc
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def load() -> Settings:
    stored = read_config_file()
    server, server_source = DEFAULT_SERVER, "default"
    if os.environ.get(SERVER_ENV):
        server, server_source = os.environ[SERVER_ENV], "env"
    elif stored.get("server"):
        server, server_source = stored["server"], "file"
    api_key, api_key_source = None, "none"
    if os.environ.get(API_KEY_ENV):
        api_key, api_key_source = os.environ[API_KEY_ENV], "env"
    elif stored.get("api_key"):
        api_key, api_key_source = stored["api_key"], "file"
    return Settings(normalize_server(server), api_key, server_source, api_key_source)


def _toml_string(value: str) -> str:
    # A JSON string (non-ASCII left as is, so no surrogate-pair escapes) is a valid TOML
    # basic string.
    return json.dumps(value, ensure_ascii=False)


def save(server: str, api_key: str, path: Path | None = None) -> Path:
    """Store the credentials, readable by the user only. The file is written next to
    its final name and renamed, so a crash never leaves half a key behind."""
    path = path or config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = (
        "# Written by `aenv auth`; AENV_SERVER and AENV_API_KEY override these.\n"
        f"server = {_toml_string(server)}\n"
        f"api_key = {_toml_string(api_key)}\n"
    )
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        # The umask can only narrow the mode given to open(); this makes it exact.
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(staging, path)
    return path


def forget(path: Path | None = None) -> bool:
    path = path or config_path()
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def mask_key(key: str) -> str:
    if len(key) <= 12:
        return "*" * len(key)
    return f"{key[:6]}…{key[-4:]}"
