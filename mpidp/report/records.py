"""The one reader of the JSON that mpidp's tools write — a ``.json`` file (``mpidp.bench
--json``, ``bench/ab.py --json``) or JSON lines (``mpidp.train --log-json``, the summaries
bench/'s run scripts append) — for ``python -m mpidp.report`` and bench/'s summaries."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional, Union


def load(path: Union[str, Path], lines: Optional[bool] = None,
         what: str = "a line of JSON", fits: Callable[[Any], bool] = lambda record: True) -> Any:
    """JSON lines' records (a list, blank lines skipped: ``lines``, by default where the name
    ends in ``.jsonl``), else the file's one JSON value; ValueError naming the file (and the
    line: "not ``what``") where it cannot be read or parsed, or a record does not ``fit``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    if not (path.suffix == ".jsonl" if lines is None else lines):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from None
    records = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                record = json.loads(line)
                ok = fits(record)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{path}:{n}: not {what}")
            records.append(record)
    return records
