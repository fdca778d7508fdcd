"""Errors meant for people: one line that names the bad value and the fix.

The CLI prints `specflow: error: <message>` and exits 2 for any `SpecflowError`; library callers
catch it like any exception. Internal bugs stay ordinary exceptions with tracebacks.
"""
from __future__ import annotations


class SpecflowError(Exception):
    """A user-facing error: bad config, bad input, missing model, misbehaving plugin."""

    exit_code = 2


class ConfigError(SpecflowError, ValueError):
    """A config value or option that cannot be used; raised at compose time."""


class PluginError(SpecflowError):
    """A plugin failed to load, collided with another, or raised inside a hook."""


class InputError(SpecflowError, ValueError):
    """A prompt or prompt file that cannot be generated from."""
