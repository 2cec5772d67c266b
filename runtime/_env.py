"""Environment variables read by the runtime: one parser per kind of value, each raising a
``ValueError`` that names the variable (a typo is an error, never silently the default)."""

from __future__ import annotations

import os


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off", "")


def env_switch(name: str, default: bool) -> bool:
    """An on/off environment variable: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/
    ``off``/empty (any case; unset: ``default``).

    Raises: ``ValueError`` naming the variable for any other value (``RUNTIME_CPU_FUSE=flase``
    used to leave fusion on, silently)."""
    text = os.environ.get(name)
    if text is None:
        return default
    v = text.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ValueError(f"the environment variable {name}={text!r} is neither on (1, true, yes, on) "
                     "nor off (0, false, no, off); set one of those or unset it")


def env_positive_int(name: str, default: int) -> int:
    """A positive integer environment variable (unset or empty: ``default``).

    Raises: ``ValueError`` naming the variable for anything else."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise ValueError(f"the environment variable {name}={text!r} must be a positive integer "
                         f"(default {default}); fix it or unset it")
    return v
