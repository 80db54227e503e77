"""attnhub's environment variables, read through one parser per kind.

===================================  ======  =======================================
variable                             kind    read by
===================================  ======  =======================================
``ATTNHUB_BACKEND``                  list    dispatch, when a call signature is decided
``ATTNHUB_STRICT``                   flag    dispatch, when a call signature is decided
``ATTNHUB_RANKING``                  choice  dispatch, when a call signature is decided
``ATTNHUB_DISABLE_PLUGIN_AUTOLOAD``  flag    the registry, when it loads
``ATTNHUB_DISABLE_PLUGINS``          list    the registry, when it loads
``ATTNHUB_TRACE_PLUGINS``            flag    the registry, when it loads
``ATTNHUB_AUTOTUNE``                 flag    autotune, when a new call signature runs
                                             (on where unset: ``0`` turns measuring off)
``ATTNHUB_MEASUREMENTS``             path    measured, when a store is first read: the
                                             measurement file, instead of the one per
                                             device in the user's cache directory
                                             (merged into, never overwritten if not
                                             attnhub's: :mod:`attnhub.measured`)
===================================  ======  =======================================

Tuning runs of the Triton backends (forced launch configurations, the backward's launch
mode) use a scoped context, ``attnhub.backends.triton_flash.tuning.override``, not a
variable.

The grammar, the same for every variable of a kind:

- **flag**: ``1``, ``true``, ``yes``, ``on`` turn it on; ``0``, ``false``, ``no``, ``off``
  turn it off; any case, surrounding blanks ignored. Unset, empty or blank is off
  (``ATTNHUB_AUTOTUNE``: on).
- **list**: comma-separated names; blanks around a name and empty items are ignored,
  and a name given twice counts once. Unset, blank or nothing but commas is no list
  (the empty tuple), the same as unset: ``ATTNHUB_BACKEND=",,,"`` restricts nothing.
- **choice**: one of the variable's words, any case, surrounding blanks ignored;
  unset, empty or blank is its default.
- **path**: a file's path, ``~`` expanded, surrounding blanks ignored; unset, empty
  or blank is no path.

Anything else is a ``ValueError`` that names the variable, the value and the accepted
values: a typo never silently means "on" (``ATTNHUB_STRICT=false`` used to) or "off".
The error surfaces where the variable is read, so a bad ``ATTNHUB_STRICT`` fails every
attention call and a bad ``ATTNHUB_TRACE_PLUGINS`` the registry's loading, each with
the same message, rather than letting a misconfigured process run on a guess.

Parsing is cached per (variable, raw value): the call path re-reads the raw strings
(cheap) and parses only a value it has not seen.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path

FLAG_ON = ("1", "true", "yes", "on")
FLAG_OFF = ("0", "false", "no", "off")
FLAG_WORDS: Mapping[str, bool] = {**dict.fromkeys(FLAG_ON, True), **dict.fromkeys(FLAG_OFF, False)}

BACKEND = "ATTNHUB_BACKEND"
STRICT = "ATTNHUB_STRICT"
RANKING = "ATTNHUB_RANKING"
DISABLE_PLUGIN_AUTOLOAD = "ATTNHUB_DISABLE_PLUGIN_AUTOLOAD"
DISABLE_PLUGINS = "ATTNHUB_DISABLE_PLUGINS"
TRACE_PLUGINS = "ATTNHUB_TRACE_PLUGINS"
AUTOTUNE = "ATTNHUB_AUTOTUNE"
MEASUREMENTS = "ATTNHUB_MEASUREMENTS"


@functools.lru_cache(maxsize=256)
def parse_flag(name: str, raw: str | None, default: bool = False) -> bool:
    """The boolean that ``raw``, the value of variable ``name``, means (None or blank:
    ``default``)."""
    word = (raw or "").strip().lower()
    if not word:
        return default
    try:
        return FLAG_WORDS[word]
    except KeyError:
        raise ValueError(
            f"{name}={raw!r} is not a boolean: use {', '.join(FLAG_ON)} to turn it on, "
            f"{', '.join(FLAG_OFF)} to turn it off (any case), or leave it unset"
        ) from None


@functools.lru_cache(maxsize=256)
def parse_list(name: str, raw: str | None) -> tuple[str, ...]:
    """The names in ``raw``, the comma-separated value of ``name``, in order, once each.

    Every value parses (``name`` is for the same signature as the other parsers): the
    names themselves are checked by whoever knows them (dispatch, for backend names).
    """
    del name
    items = (item.strip() for item in (raw or "").split(","))
    return tuple(dict.fromkeys(item for item in items if item))


@functools.lru_cache(maxsize=256)
def parse_choice(
    name: str, raw: str | None, words: tuple[tuple[str, str], ...], default: str
) -> str:
    """The canonical value that ``raw`` means among ``words``, (word, value) pairs."""
    word = (raw or "").strip().lower()
    if not word:
        return default
    for accepted, value in words:
        if word == accepted:
            return value
    raise ValueError(
        f"{name}={raw!r} is not one of {', '.join(w for w, _ in words)} (any case); "
        f"leave it unset for the default, {default}"
    )


def flag(name: str, default: bool = False) -> bool:
    """Flag variable ``name`` as it is now (see the module docstring for the grammar);
    ``default`` where it is unset or blank."""
    return parse_flag(name, os.environ.get(name), default)


def names(name: str) -> tuple[str, ...]:
    """List variable ``name`` as it is now; the empty tuple when it names nothing."""
    return parse_list(name, os.environ.get(name))


def choice(name: str, words: tuple[tuple[str, str], ...], default: str) -> str:
    """Choice variable ``name`` as it is now: the value its word maps to, or ``default``."""
    return parse_choice(name, os.environ.get(name), words, default)


def path(name: str) -> Path | None:
    """Path variable ``name`` as it is now, or None where it is unset or blank."""
    raw = (os.environ.get(name) or "").strip()
    return Path(raw).expanduser() if raw else None
