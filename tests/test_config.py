"""Pure-logic tests of the server configuration: coercion of each kind of value,
precedence of the sources, unknown keys refused with the valid ones, errors naming the
key, and the settings the server used to read from its environment elsewhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentenv.config import NOT_SETTINGS, Config, ConfigError
from agentenv.server import NodeSetupError, check_tls
from agentenv.snapshots.objects import S3ObjectStore, open_store
from agentenv.snapshots.settings import S3Settings
from agentenv.storage.oci import _policy_args
from agentenv.vmm.firecracker_binary import FIRECRACKER_ENV, find_firecracker
from tests.local_ca import make_local_ca


def load(home: Path, env: dict[str, str] | None = None, **overrides: Any) -> Config:
    return Config.load(env={"AENV_HOME": str(home), **(env or {})}, **overrides)


def write_file(home: Path, text: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(text)


# -- coercion ----------------------------------------------------------------------------


def test_defaults(tmp_path: Path) -> None:
    config = Config.load(env={}, home=tmp_path)
    assert config.listen == "127.0.0.1:8000" and config.vcpus == 2
    assert config.repository_url == (tmp_path / "repository").resolve().as_uri()
    assert config.cache_bytes == 20 << 30
    assert config.s3 == S3Settings() and config.firecracker is None
    assert config.user_home == Path("/root")
    assert config.db_path == tmp_path / "state.db"
    assert config.templates_dir == tmp_path / "templates"


def test_environment_strings_are_coerced(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        {
            "AENV_VCPUS": " 4 ",
            "AENV_NETWORK_LINGER": "2.5",
            "AENV_IMAGE_CACHE": "/images",
            "AENV_FIRECRACKER": "/opt/fc",
            "AENV_CACHE_SIZE": "512M",
            "AENV_LOG_LEVEL": "DEBUG",
            "AENV_TEMPLATE_BOOT_ATTEMPTS": "5",
        },
    )
    assert config.vcpus == 4
    assert config.network_linger == 2.5
    assert config.image_cache == Path("/images")
    assert config.firecracker == Path("/opt/fc")
    assert config.cache_bytes == 512 << 20
    assert config.log_level == "debug"
    assert config.template_boot_attempts == 5


@pytest.mark.parametrize(
    ("word", "flag"),
    [
        *[("1", True), ("true", True), ("Yes", True), ("on", True)],
        *[("0", False), ("false", False), ("NO", False), ("off", False)],
    ],
)
def test_flags_from_environment_words(tmp_path: Path, word: str, flag: bool) -> None:
    config = load(tmp_path, {"AENV_HONOUR_V1_SECURE_FLAG": word})
    assert config.honour_v1_secure_flag is flag


def test_file_values_are_coerced(tmp_path: Path) -> None:
    write_file(
        tmp_path,
        "cache_size = 1073741824\nnode_id = 7\nhonour_v1_secure_flag = true\n"
        'network_linger = 3\nrepository = "s3://bucket/prefix"\n',
    )
    config = load(tmp_path)
    assert config.cache_bytes == 1 << 30
    assert config.node_id == "7" and config.node_name == "7"
    assert config.honour_v1_secure_flag is True
    assert config.network_linger == 3.0
    assert config.repository_url == "s3://bucket/prefix"


def test_agentenv_table_in_file(tmp_path: Path) -> None:
    write_file(tmp_path, '[agentenv]\nlisten = "0.0.0.0:9000"\n[agentenv.s3]\nregion = "eu"\n')
    config = load(tmp_path)
    assert config.port == 9000 and config.s3.region == "eu"


# -- precedence --------------------------------------------------------------------------


def test_precedence_arguments_over_environment_over_file(tmp_path: Path) -> None:
    write_file(tmp_path, "vcpus = 4\nmemory_mib = 1024\nmax_timeout = 600\n")
    config = load(tmp_path, {"AENV_VCPUS": "3", "AENV_MEMORY_MIB": "2048"}, vcpus=1)
    assert config.vcpus == 1  # argument
    assert config.memory_mib == 2048  # environment
    assert config.max_timeout == 600  # file
    assert config.default_timeout == 300  # default
    # None arguments (unset command-line options) leave the value alone.
    assert load(tmp_path, listen=None).listen == "127.0.0.1:8000"


def test_config_file_named_by_variable(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere.toml"
    other.write_text("vcpus = 6\n")
    write_file(tmp_path / "home", "vcpus = 4\n")
    config = load(tmp_path / "home", {"AENV_CONFIG": str(other)})
    assert config.vcpus == 6
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "home", {"AENV_CONFIG": str(tmp_path / "missing.toml")})


def test_s3_settings_merge_file_and_environment_per_field(tmp_path: Path) -> None:
    write_file(tmp_path, '[s3]\nendpoint_url = "http://file:9000"\nregion = "file-region"\n')
    config = load(
        tmp_path,
        {
            "AWS_REGION": "env-region",
            "AWS_DEFAULT_REGION": "ignored",
            "AWS_ACCESS_KEY_ID": "id",
            "AWS_SECRET_ACCESS_KEY": "s3cr3t-value",
        },
    )
    assert config.s3.endpoint_url == "http://file:9000"
    assert config.s3.region == "env-region"
    assert config.s3.access_key_id == "id"
    assert config.s3.secret_access_key is not None
    assert config.s3.secret_access_key.get_secret_value() == "s3cr3t-value"
    assert "s3cr3t-value" not in repr(config)


def test_user_home_from_home_variable(tmp_path: Path) -> None:
    assert load(tmp_path, {"HOME": "/home/someone"}).user_home == Path("/home/someone")


def test_with_overrides_validates(tmp_path: Path) -> None:
    config = load(tmp_path)
    assert config.with_overrides(vcpus=8).vcpus == 8
    assert config.vcpus == 2
    with pytest.raises(ConfigError, match="vcpus"):
        config.with_overrides(vcpus=0)
    with pytest.raises(ConfigError, match="unknown key cpus"):
        config.with_overrides(cpus=8)


# -- unknown keys ------------------------------------------------------------------------


def test_unknown_file_key_refused_with_valid_keys(tmp_path: Path) -> None:
    write_file(tmp_path, "vcpu = 3\n")
    with pytest.raises(ConfigError) as info:
        load(tmp_path)
    message = str(info.value)
    assert "unknown key vcpu" in message and "config.toml" in message
    assert "did you mean vcpus?" in message
    assert "valid keys: accel, api_key," in message and "vmm" in message


def test_unknown_s3_key_refused_with_valid_keys(tmp_path: Path) -> None:
    write_file(tmp_path, '[s3]\nregon = "eu"\n')
    with pytest.raises(ConfigError, match=r"unknown key s3\.regon .*valid keys: s3\.access_key_id"):
        load(tmp_path)


def test_keys_outside_the_agentenv_table_refused(tmp_path: Path) -> None:
    write_file(tmp_path, 'vcpus = 3\n[agentenv]\nlisten = "0.0.0.0:9000"\n')
    with pytest.raises(ConfigError, match="vcpus outside the"):
        load(tmp_path)


def test_unknown_argument_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key lisen as an argument .*listen"):
        load(tmp_path, lisen="0.0.0.0:1")


def test_unknown_aenv_variable_refused_with_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, {"AENV_LISTN": "0.0.0.0:1"})
    message = str(info.value)
    assert "unknown setting AENV_LISTN" in message
    assert "did you mean AENV_LISTEN?" in message
    assert "AENV_VCPUS" in message and "AENV_SERVER" in message


def test_variables_that_are_not_settings_are_allowed(tmp_path: Path) -> None:
    env = dict.fromkeys(NOT_SETTINGS - {"AENV_CONFIG"}, "1")
    # Not AENV_ at all, or empty: not ours to judge.
    env.update({"AENV_TYPO": "", "AWS_PROFILE": "x", "PATH": "/bin"})
    assert load(tmp_path, env).vcpus == 2


# -- bad values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("AENV_LISTEN", "nohost", "host:port"),
        ("AENV_VCPUS", "many", "valid integer"),
        ("AENV_VCPUS", "0", "greater than or equal to 1"),
        ("AENV_MEMORY_MIB", "64", "greater than or equal to 128"),
        ("AENV_VMM", "bochs", "'auto', 'qemu' or 'firecracker'"),
        ("AENV_ACCEL", "hvf", "'auto', 'kvm' or 'tcg'"),
        ("AENV_SANDBOX_MEMORY", "swap", "'shared-image'"),
        ("AENV_NETWORK_LINGER", "soon", "valid number"),
        ("AENV_HONOUR_V1_SECURE_FLAG", "maybe", "valid boolean"),
        ("AENV_CACHE_SIZE", "lots", "size such as"),
        ("AENV_REPOSITORY", "http://x", "file:///path or s3://"),
        ("AENV_LOG_LEVEL", "loud", "debug, info"),
    ],
)
def test_bad_value_names_key_source_and_value(
    tmp_path: Path, variable: str, value: str, expected: str
) -> None:
    key = variable.removeprefix("AENV_").lower()
    with pytest.raises(ConfigError) as info:
        load(tmp_path, {variable: value})
    message = str(info.value)
    assert message.startswith(f"{key} (from {variable}): ")
    assert expected in message
    assert f"got {value!r}" in message


def test_bad_file_value_names_the_file(tmp_path: Path) -> None:
    write_file(tmp_path, 'vcpus = "many"\n')
    with pytest.raises(ConfigError, match=r"vcpus \(in .*config\.toml\): .*got 'many'"):
        load(tmp_path)


def test_every_bad_value_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, {"AENV_VCPUS": "many", "AENV_VMM": "bochs"})
    assert "vcpus" in str(info.value) and "vmm" in str(info.value)


def test_timeouts_checked_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"default_timeout .* at most max_timeout"):
        load(tmp_path, {"AENV_DEFAULT_TIMEOUT": "600", "AENV_MAX_TIMEOUT": "60"})


def test_tls_certificate_and_key_go_together(tmp_path: Path) -> None:
    assert load(tmp_path).url == "http://127.0.0.1:8000"
    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        load(tmp_path, {"AENV_TLS_CERT": "/etc/cert.pem"})
    ca = make_local_ca(tmp_path / "ca", "aenv.test")
    config = load(
        tmp_path, {"AENV_TLS_CERT": str(ca.server_cert), "AENV_TLS_KEY": str(ca.server_key)}
    )
    assert (config.scheme, config.url) == ("https", "https://127.0.0.1:8000")
    check_tls(config)
    # A key that is not the certificate's, or a missing file: refused at start-up.
    other = make_local_ca(tmp_path / "other", "aenv.test")
    for cert, key in ((ca.server_cert, other.server_key), (ca.server_cert, tmp_path / "none")):
        with pytest.raises(NodeSetupError, match="cannot use tls_cert"):
            check_tls(config.with_overrides(tls_cert=cert, tls_key=key))


def test_secret_values_not_repeated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, api_key=["e2b_secret"])
    assert "api_key (as an argument)" in str(info.value)
    assert "e2b_secret" not in str(info.value)


# -- what the server reads through Config ------------------------------------------------


def test_s3_store_is_opened_with_configured_settings() -> None:
    settings = S3Settings.model_validate(
        {"endpoint_url": "http://127.0.0.1:1", "region": "eu-test", "access_key_id": "id"}
    )
    store = open_store("s3://bucket/prefix", settings)
    assert isinstance(store, S3ObjectStore)
    client = store._make_client()
    assert client.meta.region_name == "eu-test"
    assert client.meta.endpoint_url == "http://127.0.0.1:1"
    # A mapping is still read as AWS_* variables.
    from_env = open_store("s3://bucket", {"AWS_ENDPOINT_URL": "http://127.0.0.1:2"})
    assert isinstance(from_env, S3ObjectStore)
    assert from_env._make_client().meta.endpoint_url == "http://127.0.0.1:2"


def test_firecracker_binary_from_config_not_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    configured = tmp_path / "fc"
    configured.write_text("#!/bin/sh\n")
    configured.chmod(0o755)
    monkeypatch.setenv(FIRECRACKER_ENV, str(tmp_path / "not-this-one"))
    assert find_firecracker(configured) == configured
    monkeypatch.setattr(
        "agentenv.vmm.firecracker_binary.DEFAULT_FIRECRACKER_PATH", tmp_path / "missing"
    )
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    # Nothing configured: the variable is not consulted behind Config's back.
    assert find_firecracker(None) is None


def test_skopeo_policy_looked_up_in_configured_home(tmp_path: Path) -> None:
    user_home = tmp_path / "home"
    (user_home / ".config/containers").mkdir(parents=True)
    (user_home / ".config/containers/policy.json").write_text("{}")
    assert _policy_args(tmp_path / "cache", user_home) == []
