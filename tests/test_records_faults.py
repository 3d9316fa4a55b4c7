"""Both generations of a record bad, and one cannot be set aside: the ERROR line says so, not "set aside".

A folder in a record's place (or a ``*.corrupt`` folder from an earlier look) cannot be renamed over
an older ``*.corrupt`` file: the rename failed silently and the line still said ``set aside as
*.corrupt``, while the folder stayed and every later write of the record failed on it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from edgefl.records import prev_path, read_record


def test_corrupt_both_generations_one_not_set_aside_is_named_with_what_to_do(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "global_head.rec"
    path.mkdir()  # a folder where the record should be
    (tmp_path / "global_head.rec.corrupt").write_bytes(b"an earlier incident's file")
    prev_path(path).write_bytes(b"\x00garbage" * 8)
    with caplog.at_level(logging.ERROR, logger="edgefl.records"):
        assert read_record(path) is None
    assert path.is_dir() and (tmp_path / "global_head.rec.prev.corrupt").is_file()
    [line] = [r.getMessage() for r in caplog.records]
    assert "set aside as *.corrupt, except global_head.rec (" in line, line
    assert "Is a directory" in line and "move it away by hand), starting empty" in line, line
