"""The network package's error."""

from __future__ import annotations


class NetworkError(Exception):
    """A sandbox network could not be created, inspected or removed."""
