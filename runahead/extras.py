"""Optional packages and the extra of ``pyproject.toml`` that installs each: one line to tell the user.

The command line turns a missing optional package into that line (exit status 1); :func:`needs_extras`
does the same for library calls that import one (``Engine.open`` and torch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

EXTRAS = {
    "torch": "torch",
    "safetensors": "torch",
    "transformers": "torch",
    "tokenizers": "torch",
    "starlette": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "matplotlib": "plot",
    "uvloop": "uvloop",
    "mlx": "mlx",
    "mlx_lm": "mlx",
}
"""Top-level module -> the extra of ``pyproject.toml`` that installs it."""


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """One line naming the extra to install for a missing optional package, or ``None`` if it is not one."""
    module = (error.name or "").partition(".")[0]
    extra = EXTRAS.get(module)
    if extra is None:
        return None
    return f"this needs the {module!r} package: pip install 'runahead[{extra}]' (or 'runahead[all]')"


@contextmanager
def needs_extras() -> Iterator[None]:
    """Re-raise a missing optional package imported in the block as an error naming its extra."""
    try:
        yield
    except ModuleNotFoundError as error:
        hint = missing_extra(error)
        if hint is None or str(error) == hint:
            raise
        raise ModuleNotFoundError(hint, name=error.name) from error
