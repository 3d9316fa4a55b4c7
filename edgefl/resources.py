"""Files the package ships (models, profiles, the demo's data set), found alike in a checkout and a wheel.

They live in the top-level folders ``models/``, ``firmware_configs/`` and ``data/``, which setup.cfg's
``package_dir`` maps to the data-only packages ``edgefl.models``, ``edgefl.firmware_configs`` and
``edgefl.data``; the import system finds those folders in a wheel and in an editable install alike.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

FOLDERS = ("models", "firmware_configs", "data")
"""The shipped folders: the packages ``edgefl.models``, ``edgefl.firmware_configs`` and ``edgefl.data``."""


def shipped(relative: str) -> Path:
    """The path of a file the package ships, e.g. ``shipped("models/digits_cnn_int8_rawin.tflite")``.

    Parameters
    ----------
    relative : str
        Path under the package, with ``/`` separators: ``models/...``, ``firmware_configs/...``,
        ``data/sklearn_digits/...``.

    Returns
    -------
    Path
        Absolute path (it may not exist when the wheel was built without that file).

    Raises
    ------
    ValueError
        ``relative`` does not start with one of :data:`FOLDERS`.
    """
    folder, *rest = relative.strip("/").split("/")
    if folder not in FOLDERS:
        raise ValueError(f"{relative!r}: not under a folder edgefl ships ({', '.join(FOLDERS)})")
    return Path(str(importlib.resources.files(f"edgefl.{folder}"))).joinpath(*rest)
