"""The README's settings table, written from `gateway.settings` so that the two cannot drift.

One row per field of `Settings`, in the order and under the section comments of settings.py
(a one-line comment after a blank line in the class body opens a section): its name and flag,
its environment variable, its default, whether a reload applies it, and its description.

    python -m gateway.settings_doc                  # print the table
    python -m gateway.settings_doc --write README.md  # replace it between the markers

`tests/gateway/test_gw_settings_doc.py` fails when the README's copy differs from this output.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from gateway.settings import ENV_PREFIX, RELOADABLE_SETTINGS, PriorityClass, Settings

BEGIN_MARKER = "<!-- settings:begin -->"
END_MARKER = "<!-- settings:end -->"
WRITE_COMMAND = "python -m gateway.settings_doc --write README.md"

_SECTION_COMMENT = re.compile(r"^    # (?P<title>[^\s].*?)\.?$")
_FIELD_LINE = re.compile(r"^    (?P<name>[a-z_][a-z0-9_]*): ")


def sections(source: str, names: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The fields `names` grouped under the section comments of the class body `source`, in
    source order; fields outside any section (or not found) go under "Other", last."""
    grouped: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    previous_blank = False
    for line in source.splitlines():
        section = _SECTION_COMMENT.match(line)
        if section is not None and previous_blank:
            grouped.append((section["title"], []))
        field = _FIELD_LINE.match(line)
        if field is not None and field["name"] in names and field["name"] not in seen:
            if not grouped:
                grouped.append(("Other", []))
            grouped[-1][1].append(field["name"])
            seen.add(field["name"])
        previous_blank = not line.strip()
    rest = [name for name in names if name not in seen]
    if rest:
        grouped.append(("Other", rest))
    return [(title, fields) for title, fields in grouped if fields]


def _value(value: Any, *, in_bytes: bool = False) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if in_bytes and isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
            if value % size == 0:
                return f"{value} ({value // size} {unit})"
    return str(value)


def _class_defaults() -> str:
    parts = [f"`{name}` {_value(field.default)}" for name, field in PriorityClass.model_fields.items()]
    return "each class: " + ", ".join(parts)


def default_text(name: str, field: FieldInfo) -> str:
    """How the table shows a field's default."""
    if name == "priority_classes":
        return _class_defaults()
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        return "set" if value.get_secret_value() else "unset"
    if isinstance(value, BaseModel):
        return f"`{value.model_dump_json()}`"
    return f"`{_value(value, in_bytes=name.endswith('_bytes'))}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table(flags: Mapping[str, str] | None = None, source: str | None = None) -> str:
    """The markdown of every setting. `flags` maps a field to its own command-line flag (the
    rest are set with --set); `source` is the Settings class's source (default: read it)."""
    flags = dict(flags or {})
    fields = Settings.model_fields
    text = source if source is not None else inspect.getsource(Settings)
    lines: list[str] = []
    for title, names in sections(text, list(fields)):
        lines += [
            f"**{title}**",
            "",
            "| setting | environment | default | reload | what |",
            "|---|---|---|---|---|",
        ]
        for name in names:
            field = fields[name]
            setting = f"`{name}`" + (f" (`{flags[name]}`)" if name in flags else "")
            lines.append(
                "| "
                + " | ".join(
                    (
                        setting,
                        f"`{ENV_PREFIX}{name.upper()}`",
                        _cell(default_text(name, field)),
                        "yes" if name in RELOADABLE_SETTINGS else "restart",
                        _cell(field.description or ""),
                    )
                )
                + " |"
            )
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def serve_flags() -> dict[str, str]:
    """Each setting that `kvgate serve` has a flag of its own for, with that flag."""
    from gateway import serve_cli

    subparsers = argparse.ArgumentParser().add_subparsers()
    serve_cli.register(subparsers)
    serve = subparsers.choices["serve"]
    flags = {}
    for action in serve._actions:
        if not action.option_strings:
            continue
        for name in serve_cli.FLAG_SETTINGS.get(action.dest, (action.dest,)):
            if name in Settings.model_fields:
                flags[name] = max(action.option_strings, key=len)
    return flags


def replaced(document: str, table: str) -> str:
    """`document` with `table` between the markers. Raises ValueError without both markers."""
    begin = document.find(BEGIN_MARKER)
    end = document.find(END_MARKER)
    if begin < 0 or end < begin:
        raise ValueError(f"needs {BEGIN_MARKER} and then {END_MARKER}")
    return document[: begin + len(BEGIN_MARKER)] + "\n" + table + document[end:]


def embedded(document: str) -> str | None:
    """The table between the markers of `document` (None without them)."""
    begin = document.find(BEGIN_MARKER)
    end = document.find(END_MARKER)
    if begin < 0 or end < begin:
        return None
    return document[begin + len(BEGIN_MARKER) : end].removeprefix("\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.settings_doc", description="Print (or write) the README's settings table."
    )
    parser.add_argument("--write", type=Path, metavar="FILE", help="replace the table between the markers")
    args = parser.parse_args(argv)
    table = settings_table(serve_flags())
    if args.write is None:
        sys.stdout.write(table)
        return 0
    try:
        args.write.write_text(replaced(args.write.read_text(encoding="utf-8"), table), encoding="utf-8")
    except ValueError as exc:
        print(f"{args.write}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
