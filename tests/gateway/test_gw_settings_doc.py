"""The README's settings table is the one gateway.settings_doc writes from gateway/settings.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import PriorityClass, Settings
from gateway.settings_doc import (
    BEGIN_MARKER,
    END_MARKER,
    WRITE_COMMAND,
    embedded,
    main,
    sections,
    serve_flags,
    settings_table,
)

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_settings_table_is_the_generated_one() -> None:
    in_readme = embedded(README.read_text(encoding="utf-8"))
    assert in_readme is not None, f"README.md lacks {BEGIN_MARKER} ... {END_MARKER}"
    assert in_readme == settings_table(serve_flags()), (
        f"README.md's settings table is stale: run {WRITE_COMMAND}"
    )


@pytest.mark.parametrize(
    ("model", "name"),
    [(Settings, name) for name in Settings.model_fields]
    + [(PriorityClass, name) for name in PriorityClass.model_fields],
)
def test_every_setting_has_a_description(model: type[Settings] | type[PriorityClass], name: str) -> None:
    description = model.model_fields[name].description
    assert description is not None, f"{model.__name__}.{name} needs Field(description=...)"
    assert description.strip(), f"{model.__name__}.{name} has an empty description"


def test_every_setting_has_exactly_one_row() -> None:
    table = settings_table(serve_flags())
    for name in Settings.model_fields:
        assert table.count(f"| `{name}`") == 1, name
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(Settings.model_fields)


def test_sections_come_from_blank_line_comments_and_unplaced_fields_go_last() -> None:
    source = "\n".join(
        [
            "class S:",
            "",
            "    # First part.",
            "    a: int = 1",
            "    # Explains b, not a section.",
            "    b: int = 2",
            "",
            "    # Second part.",
            "    c: int = 3",
        ]
    )
    assert sections(source, ["a", "b", "c", "d"]) == [
        ("First part", ["a", "b"]),
        ("Second part", ["c"]),
        ("Other", ["d"]),
    ]


def test_defaults_are_shown_for_people() -> None:
    table = settings_table(serve_flags())
    row = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| `")}
    assert "| unset |" in row["| `backend_url` (`--backend`)"]
    assert "| `[]` |" in row["| `backends` (`--backend`)"]
    assert "| unset |" in row["| `admin_token`"]
    assert "`queue_max` 256" in row["| `priority_classes`"]
    assert "(8 MiB)" in row["| `max_body_bytes`"]
    assert "| `false` |" in row["| `trust_request_chat_template`"]


def test_write_replaces_only_what_lies_between_the_markers(tmp_path: Path) -> None:
    document = tmp_path / "README.md"
    document.write_text(
        f"# Title\n\nbefore\n{BEGIN_MARKER}\nold table\n{END_MARKER}\nafter\n", encoding="utf-8"
    )
    assert main(["--write", str(document)]) == 0
    text = document.read_text(encoding="utf-8")
    assert text.startswith(f"# Title\n\nbefore\n{BEGIN_MARKER}\n")
    assert text.endswith(f"{END_MARKER}\nafter\n")
    assert "old table" not in text
    assert embedded(text) == settings_table(serve_flags())


def test_write_refuses_a_file_without_markers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = tmp_path / "README.md"
    document.write_text("# no markers\n", encoding="utf-8")
    assert main(["--write", str(document)]) == 2
    assert BEGIN_MARKER in capsys.readouterr().err
    assert document.read_text(encoding="utf-8") == "# no markers\n"
