"""How to reach an S3-compatible snapshot repository: :class:`S3Settings`, the endpoint,
credentials and region an ``s3://`` store is opened with, and the ``AWS_*`` environment
variables each is conventionally read from.

Kept apart from :mod:`agentenv.snapshots.objects` so the server's configuration can
hold these settings without importing boto3.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, SecretStr


class S3Settings(BaseModel):
    """Endpoint, credentials and region for an S3 repository. Unset credentials leave
    boto3 to its own lookup (shared credentials file, instance metadata)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # None: AWS itself.
    endpoint_url: str | None = None
    access_key_id: str | None = None
    # Secrets, so that a logged or printed configuration does not show them.
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None
    region: str = "us-east-1"

    #: Field -> the environment variables it is read from, first set one wins (the names
    #: the AWS tools use).
    ENVIRONMENT: ClassVar[dict[str, tuple[str, ...]]] = {
        "endpoint_url": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
        "access_key_id": ("AWS_ACCESS_KEY_ID",),
        "secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
        "session_token": ("AWS_SESSION_TOKEN",),
        "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    }

    @classmethod
    def environment_values(cls, env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
        """Field -> (variable, value) for each field ``env`` sets (empty counts as unset)."""
        found: dict[str, tuple[str, str]] = {}
        for name, variables in cls.ENVIRONMENT.items():
            for variable in variables:
                if env.get(variable):
                    found[name] = (variable, env[variable])
                    break
        return found

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> S3Settings:
        values = {name: value for name, (_, value) in cls.environment_values(env).items()}
        return cls.model_validate(values)
