"""The ``config`` part of the Helm chart's values.schema.json, made from :data:`SETTINGS` and what
each parser accepts (:data:`~mpsd.config.settings.SCHEMAS`): one object per section, no key but
mpsd's own (``additionalProperties: false`` at every level), each value as its parser takes it.
So ``helm install/template/lint`` refuse a misspelled key or a bad value in one line, and the
schema cannot drift from the settings (scripts/gen-chart-schema.py writes it,
tests/deploy/test_chart_schema.py compares). Pure: text in, text out."""

from __future__ import annotations

import json
import re
from typing import Any

from .settings import SCHEMAS, SETTINGS, VERSION

# values.schema.json's top-level `config` property, at the indentation the file gives it
_CONFIG = re.compile(r'^    "config": ', re.MULTILINE)


def config_schema() -> dict[str, Any]:
    """The JSON schema of a chart's ``config`` value: every setting, typed and bounded, optional
    (the chart merges it over its own config file), nothing else."""
    root = _object("mpsd's configuration (docs/configuration.md), merged over the chart's config file")
    root["properties"]["version"] = {"const": VERSION}
    for s in SETTINGS:
        *sections, name = s.key.split(".")
        node = root
        for section in sections:
            node = node["properties"].setdefault(section, _object(f"the {section} settings"))
        if s.parse not in SCHEMAS:
            raise ValueError(f"{s.key}: its parser {s.parse.__qualname__} says nothing of what it accepts "
                             "(record it with _accepts in mpsd/config/settings.py)")
        node["properties"][name] = {**SCHEMAS[s.parse], "description": s.help.replace("%%", "%")}
    return root


def _object(description: str) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "description": description, "properties": {}}


def with_config(text: str) -> str:
    """values.schema.json's text with its top-level ``config`` property replaced by
    :func:`config_schema` (one setting a line); every other byte as it was."""
    found = list(_CONFIG.finditer(text))
    if len(found) != 1:
        raise ValueError(f'expected one top-level "config" property indented 4 spaces, found {len(found)}')
    start = found[0].end()
    _, end = json.JSONDecoder().raw_decode(text, start)
    return text[:start] + _format(config_schema(), 4) + text[end:]


def _format(node: dict[str, Any], indent: int) -> str:
    """An object schema and its properties expanded, a setting's schema on one line."""
    pad = " " * (indent + 2)
    lines = []
    for key, value in node.items():
        if key == "properties":
            inner = " " * (indent + 4)
            props = [f"{inner}{json.dumps(k)}: {_format(v, indent + 4) if 'properties' in v else _line(v)}"
                     for k, v in value.items()]
            lines.append(f'{pad}"properties": {{\n' + ",\n".join(props) + f"\n{pad}}}")
        else:
            lines.append(f"{pad}{json.dumps(key)}: {_line(value)}")
    return "{\n" + ",\n".join(lines) + "\n" + " " * indent + "}"


def _line(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
