"""Files the package ships (models, profiles, the demo's data set), found alike in a checkout and a wheel.

setup.cfg's ``package_dir`` maps ``models/``, ``firmware_configs/`` and ``data/`` to the data-only
packages ``edgefl.models``, ``edgefl.firmware_configs`` and ``edgefl.data``.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

FOLDERS = ("models", "firmware_configs", "data")
"""The shipped folders: the packages ``edgefl.models``, ``edgefl.firmware_configs`` and ``edgefl.data``."""


def shipped(relative: str) -> Path:
    """The absolute path of a shipped file, e.g. ``shipped("models/digits_cnn_int8_rawin.tflite")``.

    ``relative`` uses ``/`` and starts with one of :data:`FOLDERS` (else ValueError); the file may be
    missing from a wheel built without it.
    """
    folder, *rest = relative.strip("/").split("/")
    if folder not in FOLDERS:
        raise ValueError(f"{relative!r}: not under a folder edgefl ships ({', '.join(FOLDERS)})")
    return Path(str(importlib.resources.files(f"edgefl.{folder}"))).joinpath(*rest)
