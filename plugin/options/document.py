"""Reading a config file, for the plugin and the fleet controller alike: its text, parsed as JSON (a ``.json`` name)
or YAML, every way of failing one ``FieldError`` that names where the path came from. What the document must hold
is each program's own business."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plugin.validation import FieldError


def read_document(path: Path, label: str) -> Any:
    """The parsed file; ``label`` is how the user named it (``--config``, or the environment variable)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise FieldError(label, f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise FieldError(label, f"{path} is not a text file") from None
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except ValueError as exc:
            raise FieldError(label, f"{path} is not valid JSON: {str(exc).splitlines()[0]}") from None
    # Imported here, not at the top: a program configured by flags and the environment alone never loads the YAML
    # parser, which keeps it out of the start-up RSS (issue 14).
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        where = f" (line {exc.problem_mark.line + 1})" if exc.problem_mark is not None else ""
        raise FieldError(label, f"{path} is not valid YAML: {exc.problem or exc.context}{where}") from None
    except (ValueError, yaml.YAMLError) as exc:
        raise FieldError(label, f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
