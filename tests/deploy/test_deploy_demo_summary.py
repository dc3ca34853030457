"""`make demo`'s summary of a burst: the table and the sentence read what bench wrote."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from deploy_files import load_script


def load() -> ModuleType:
    return load_script("demo_summary")


DIRECT = {
    "ok": 25,
    "late": 15,
    "shed": 0,
    "preemptions": 36.0,
    "useful_tokens_per_s": 1000.0,
    "ttft_s": {"p50": 4.1},
}
GATED = {
    "ok": 30,
    "late": 0,
    "shed": 10,
    "preemptions": 2.0,
    "useful_tokens_per_s": 1200.0,
    "ttft_s": {"p50": 0.4},
}


def test_the_summary_says_what_changed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"targets": [DIRECT, GATED]}))
    assert load().main(str(summary)) == 0
    out = capsys.readouterr().out
    assert "finished within 10 s" in out
    assert "4.10" in out
    assert "0.40" in out
    assert "kvgate finished 30 in time where vLLM alone finished 25" in out
    assert "2 preemptions against 36" in out
    assert "refused 10 at once" in out
    assert "kept 120% of vLLM's useful tokens" in out


def test_nothing_refused_and_nothing_useful_say_so_plainly() -> None:
    words = load().in_words({"ok": 0, "preemptions": None}, {"ok": 0, "shed": 0})
    assert "refused" not in words
    assert "useful tokens" not in words


def test_one_preemption_is_one() -> None:
    words = load().in_words({"ok": 34, "preemptions": 66.0}, {"ok": 55, "shed": 62, "preemptions": 1.0})
    assert "with 1 preemption against 66" in words
