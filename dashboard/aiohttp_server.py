"""aiohttp's server without its HTTP client: what the dashboard imports in an agent.

``import aiohttp.web`` runs ``aiohttp/__init__.py``, which imports the HTTP client and loads the CA
store (3 MiB of an agent's RSS, docs/benchmarks.md "Hygiene"); :func:`defer_client` runs it only at
the first access to a name it defines (a module ``__getattr__``), as a plain import would have.

Source: PEP 562 (module ``__getattr__``); Python's import system, "The module cache" and
"Submodules" (docs.python.org/3/reference/import.html).
"""

from __future__ import annotations

import importlib.util
import re
import sys

_VERSION = re.compile(r'^__version__ = "([^"]+)"$', re.MULTILINE)


def defer_client() -> bool:
    """Register ``aiohttp`` with its ``__init__`` deferred (True).

    False if aiohttp was imported already or could not be read (then a plain import happens).
    """
    if "aiohttp" in sys.modules:
        return False
    spec = importlib.util.find_spec("aiohttp")
    if spec is None or spec.loader is None or spec.origin is None or spec.submodule_search_locations is None:
        return False
    try:
        with open(spec.origin, encoding="utf-8") as fh:
            found = _VERSION.search(fh.read())
    except OSError:
        return False
    if found is None:
        return False
    package = importlib.util.module_from_spec(spec)
    package.__version__ = found.group(1)  # type: ignore[attr-defined]  # aiohttp.http reads it
    loader = spec.loader

    def complete(name: str) -> object:
        # ``from . import web_app`` asks the package for a submodule first: say "not yet", and the
        # import system imports it (without the client)
        if "." not in name and importlib.util.find_spec(f"aiohttp.{name}") is not None:
            raise AttributeError(name)
        del package.__getattr__  # type: ignore[attr-defined]
        loader.exec_module(package)  # the real __init__: the client, and its own __getattr__
        return getattr(package, name)

    package.__getattr__ = complete  # type: ignore[attr-defined,method-assign]
    sys.modules["aiohttp"] = package
    return True
