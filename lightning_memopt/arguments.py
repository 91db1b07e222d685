"""Strict checks of argument values where they enter the library: one message shape for every bad input.

Values arrive from Python callers and from Hydra command lines (``fail_safe=off`` arrives as the
string ``"off"``, ``data.batch_size=abc`` as ``"abc"``). Each check returns the value in its proper
type or raises with the argument's name, the bad value and what is valid:
``ValueError`` for a value out of range or not among the choices, ``TypeError`` for a value of the
wrong kind. Booleans are strict: a string is read as a word (``"off"`` is false), never by truthiness.

Example::

    >>> check_bool("fail_safe", "off")
    False
    >>> check_int("batch_size", 32, minimum=1)
    32
    >>> check_int("batch_size", "abc", minimum=1)
    Traceback (most recent call last):
    ...
    TypeError: `batch_size` must be an integer ≥ 1, got 'abc' (str)
"""

from __future__ import annotations

import ipaddress
import math
import numbers
import os
import re
from collections.abc import Collection
from typing import Any, TypeVar

T = TypeVar("T")


class InputError(ValueError):
    """A bad input found past the arguments, in the data itself: a malformed file, a clip out of its frame.

    The apps end it, wherever it is raised (in a DataLoader worker too), with its one-line message.
    """


TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _range_text(kind: str, minimum: float | None, maximum: float | None, open_minimum: bool) -> str:
    low = None if minimum is None else f"{'>' if open_minimum else '≥'} {minimum}"
    high = None if maximum is None else f"≤ {maximum}"
    bounds = " and ".join(part for part in (low, high) if part)
    return f"{kind} {bounds}".rstrip()


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool: a bool, the integers 0 / 1, or a word of :data:`TRUE_WORDS` / :data:`FALSE_WORDS`.

    Raises:
        ValueError: any other value (``"maybe"``, ``2``, ``None``), never read by its truthiness.

    Example::

        >>> check_bool("fail_safe", "no"), check_bool("fail_safe", True)
        (False, True)
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ValueError(f"`{name}` must be true or false, got {_shown(value)}")


def check_optional_bool(name: str, value: Any) -> bool | None:
    """Like :func:`check_bool`, with ``None`` (and the words ``"null"`` / ``"none"``) kept as ``None``.

    Example::

        >>> check_optional_bool("fail_safe", None), check_optional_bool("fail_safe", "off")
        (None, False)
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none")):
        return None
    try:
        return check_bool(name, value)
    except ValueError:
        raise ValueError(f"`{name}` must be true, false or null, got {_shown(value)}") from None


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int within ``[minimum, maximum]`` (either bound may be ``None``).

    Raises:
        TypeError: not an integer (a bool, a string, a float with a fraction).
        ValueError: outside the bounds.

    Example::

        >>> check_int("patience", 3.0, minimum=1)
        3
    """
    wanted = _range_text("an integer", minimum, maximum, open_minimum=False)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value).is_integer():
        raise TypeError(f"`{name}` must be {wanted}, got {_shown(value)}")
    number = int(value)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise ValueError(f"`{name}` must be {wanted}, got {value!r}")
    return number


def check_optional_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
    """Like :func:`check_int`, with ``None`` kept as ``None``.

    Example::

        >>> check_optional_int("val_batch_size", None, minimum=1) is None
        True
    """
    return None if value is None else check_int(name, value, minimum=minimum, maximum=maximum)


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    open_minimum: bool = False,
) -> float:
    """``value`` as a finite float within the bounds (``open_minimum``: strictly above ``minimum``).

    Raises:
        TypeError: not a real number (a bool, a string).
        ValueError: not finite, or outside the bounds.

    Example::

        >>> check_float("min_loss_scale", 1, minimum=0, open_minimum=True)
        1.0
    """
    wanted = _range_text("a number", minimum, maximum, open_minimum)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be {wanted}, got {_shown(value)}")
    number = float(value)
    below = minimum is not None and (number <= minimum if open_minimum else number < minimum)
    if not math.isfinite(number) or below or (maximum is not None and number > maximum):
        raise ValueError(f"`{name}` must be {wanted}, got {value!r}")
    return number


def check_optional_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    open_minimum: bool = False,
) -> float | None:
    """Like :func:`check_float`, with ``None`` kept as ``None``.

    Example::

        >>> check_optional_float("budget", None) is None, check_optional_float("budget", 8, minimum=0)
        (True, 8.0)
    """
    if value is None:
        return None
    return check_float(name, value, minimum=minimum, maximum=maximum, open_minimum=open_minimum)


def check_fraction(name: str, value: Any, *, open_minimum: bool = False, open_maximum: bool = False) -> float:
    """``value`` as a float between 0 and 1; ``open_minimum`` / ``open_maximum`` leave that end out.

    Raises:
        TypeError: not a real number (a bool, a string).
        ValueError: not finite, or outside the interval.

    Example::

        >>> check_fraction("safety_margin", 0.1, open_maximum=True)
        0.1
        >>> check_fraction("safety_margin", 1, open_maximum=True)
        Traceback (most recent call last):
        ...
        ValueError: `safety_margin` must be a number ≥ 0 and < 1, got 1
    """
    wanted = f"a number {'>' if open_minimum else '≥'} 0 and {'<' if open_maximum else '≤'} 1"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be {wanted}, got {_shown(value)}")
    number = float(value)
    below = number <= 0 if open_minimum else number < 0
    above = number >= 1 if open_maximum else number > 1
    if not math.isfinite(number) or below or above:
        raise ValueError(f"`{name}` must be {wanted}, got {value!r}")
    return number


def check_choice(name: str, value: T, choices: Collection[T]) -> T:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: naming the valid choices.

    Example::

        >>> check_choice("schedule_interval", "epoch", ("step", "epoch"))
        'epoch'
    """
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)!r}, got {value!r}")
    return value


def check_file(name: str, value: Any) -> str:
    """``value`` as the path of an existing file.

    Raises:
        TypeError: not a path.
        FileNotFoundError: nothing there.
        IsADirectoryError: a folder where a file is expected.

    Example::

        >>> check_file("pretrained", "no/such/file.pt")
        Traceback (most recent call last):
        ...
        FileNotFoundError: `pretrained`: no file at 'no/such/file.pt'
    """
    path = check_path(name, value)
    if os.path.isdir(path):
        raise IsADirectoryError(f"`{name}`: {path!r} is a folder, not a file")
    if not os.path.exists(path):
        raise FileNotFoundError(f"`{name}`: no file at {path!r}")
    return path


def check_output_file(name: str, value: Any) -> str:
    """``value`` as the path of a file to write: a path, not a folder (the file need not exist yet).

    Raises:
        TypeError: not a path.
        IsADirectoryError: a folder.

    Example::

        >>> check_output_file("csv_path", ".")
        Traceback (most recent call last):
        ...
        IsADirectoryError: `csv_path`: '.' is a folder; give the path of a file
    """
    path = check_path(name, value)
    if os.path.isdir(path):
        raise IsADirectoryError(f"`{name}`: {path!r} is a folder; give the path of a file")
    return path


def check_path(name: str, value: Any) -> str:
    """``value`` as a path string (a ``str`` or ``os.PathLike``), not checked on disk.

    Raises:
        TypeError: anything else, or an empty string.

    Example::

        >>> check_path("csv_path", "results.csv")
        'results.csv'
    """
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise TypeError(f"`{name}` must be a path, got {_shown(value)}")
    return os.fspath(value)  # type: ignore[return-value]


_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


def check_bind_address(name: str, value: Any) -> str:
    """``value`` as the address of a network interface to bind: an IPv4 / IPv6 address or a host name.

    Raises:
        TypeError: not a string.
        ValueError: neither an IP address nor a host name (an empty string included).

    Example::

        >>> check_bind_address("prometheus_address", "127.0.0.1")
        '127.0.0.1'
        >>> check_bind_address("prometheus_address", "http://host")
        Traceback (most recent call last):
        ...
        ValueError: `prometheus_address` must be an IP address or host name to bind, e.g. '127.0.0.1' (this machine only) or '0.0.0.0' (every interface), got 'http://host'
    """  # noqa: E501
    wanted = "an IP address or host name to bind, e.g. '127.0.0.1' (this machine only) or '0.0.0.0' (every interface)"
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be {wanted}, got {value!r} ({type(value).__name__})")
    address = value.strip()
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    if _HOST_NAME.match(address):
        return address
    raise ValueError(f"`{name}` must be {wanted}, got {value!r}")
