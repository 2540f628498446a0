"""Argument types of the command line: each refuses a bad value with one line naming the option.

argparse turns the ``ArgumentTypeError`` into ``runahead <command>: error: ...`` and exit code 2,
before any model is loaded.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

DEVICE = re.compile(r"cpu|cuda(:\d+)?|gpu|auto")


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (exit code 2) that points at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.HelpFormatter):
    """Help lines that end with the option's default, when it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "(default" in text or not action.option_strings:
            return text
        shown = ",".join(map(_shown, default)) if isinstance(default, list) else _shown(default)
        return f"{text} (default: {shown})"


def _shown(value: Any) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def threads(text: str) -> int | str:
    """``auto`` or a thread count >= 1."""
    return "auto" if text == "auto" else integer(1)(text)


def number(low: float, high: float | None = None, *, open_low: bool = False) -> Callable[[str], float]:
    """A number in ``[low, high]`` (``(low, high]`` with ``open_low``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < low or (open_low and value == low) or (high is not None and value > high):
            left = "(" if open_low else "["
            below = f"> {low}" if open_low else f">= {low}"
            bound = below if high is None else f"in {left}{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


FRACTION = number(0.0, 1.0, open_low=True)
"""A cache fraction: in (0, 1]."""

POSITIVE = number(0.0, open_low=True)
"""A positive finite number (a bandwidth)."""


def listed(kind: Callable[[str], T]) -> Callable[[str], list[T]]:
    """A comma-separated list of ``kind``."""

    def parse(text: str) -> list[T]:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return [kind(part) for part in parts]

    return parse


def token_ids(text: str) -> list[int]:
    """Prompt token ids: ``1,2,3``."""
    return listed(integer(0))(text)


def barriers(text: str) -> list[bool]:
    """``on``, ``off`` or ``on,off``."""
    values = {"on": True, "off": False}
    try:
        return [values[part] for part in text.split(",")]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected on, off or on,off; got {text!r}") from None


def policy(text: str) -> str:
    """One policy spec, checked (``runahead``, ``sync/grouping=static:4``, ...)."""
    from runahead.policy import parse_policy

    try:
        parse_policy(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.strip()


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (torch), ``gpu`` or ``auto`` (mlx); whether the machine has it
    is checked when the model loads."""
    if not DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"expected cpu, cuda, cuda:N (torch), gpu or auto (mlx), got {text!r}"
        )
    return text


def check_device(name: str) -> None:
    """Refuse a CUDA device that this torch build or machine does not have (raises ``ValueError``).

    ``gpu`` and ``auto`` are the mlx backend's names, checked when it loads the model."""
    if name in ("cpu", "gpu", "auto"):
        return
    import torch

    if not torch.cuda.is_available():
        why = "is built without CUDA" if torch.version.cuda is None else "sees no CUDA device"
        raise ValueError(f"--device {name}: this torch ({torch.__version__}) {why}; use --device cpu")
    index = int(name.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")


def bytes_per_second(gbps: float | None) -> float | None:
    """``--link-gbps`` as a backend's ``link_bandwidth`` (bytes per second); no cap stays None."""
    return None if gbps is None else gbps * 1e9
