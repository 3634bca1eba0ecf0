"""docs/settings.md's reference is generated from the settings object (``scripts/settings_doc.py``) and stays so.

A field added, renamed, re-typed or re-described in ``thinkfleet/settings.py`` without regenerating the page fails
here, naming the command that regenerates it; so does a field without a description (the page would have nothing
to say about it).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from thinkfleet.settings import Settings

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "settings_doc.py"


@pytest.fixture(scope="module")
def settings_doc() -> ModuleType:
    spec = importlib.util.spec_from_file_location("settings_doc", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_settings_md_is_what_the_generator_prints(settings_doc: ModuleType) -> None:
    page = settings_doc.PAGE.read_text(encoding="utf-8")
    assert settings_doc.render_page(page) == page, (
        f"docs/settings.md is stale (thinkfleet/settings.py changed): run `{settings_doc.COMMAND}` and commit the page"
    )


def test_every_setting_is_on_the_page_with_its_variable_and_default(settings_doc: ModuleType) -> None:
    page = settings_doc.PAGE.read_text(encoding="utf-8")
    section = page[page.index(settings_doc.BEGIN) : page.index(settings_doc.END)]
    for name, field in Settings.model_fields.items():
        [row] = [line for line in section.splitlines() if line.startswith(f"| `THINKFLEET_{name.upper()}` |")]
        assert settings_doc.default(name, field).replace("|", "\\|") in row, row


def test_the_check_flag_exits_1_on_a_stale_page_and_names_the_command(settings_doc: ModuleType, tmp_path: Path) -> None:
    fresh = tmp_path / "settings.md"
    fresh.write_text(settings_doc.render_page(settings_doc.PAGE.read_text(encoding="utf-8")))
    stale = tmp_path / "stale.md"
    stale.write_text(fresh.read_text().replace("THINKFLEET_LEASE_S", "THINKFLEET_LEASE"))

    def check(page: Path) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, str(SCRIPT), "--check", "--page", str(page)]
        return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)

    assert check(fresh).returncode == 0, check(fresh).stderr
    done = check(stale)
    assert done.returncode == 1 and settings_doc.COMMAND in done.stderr, done.stderr
    assert stale.read_text() != fresh.read_text()  # --check writes nothing


def test_the_hand_written_text_around_the_markers_is_kept(settings_doc: ModuleType) -> None:
    page = f"# Intro\n\nprose\n\n{settings_doc.BEGIN}\nstale table\n{settings_doc.END}\n\nafter\n"
    rendered = settings_doc.render_page(page)
    assert rendered.startswith("# Intro\n\nprose\n\n" + settings_doc.BEGIN) and rendered.endswith(
        settings_doc.END + "\n\nafter\n"
    )
    assert "stale table" not in rendered and "`THINKFLEET_REDIS_URL`" in rendered
    with pytest.raises(settings_doc.SettingsDocError, match="needs one"):
        settings_doc.render_page("no markers here\n")


class Undocumented(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="THINKFLEET_")

    # -- new things -------------------------------------------------------------------------------------------
    documented_s: float = Field(1.0, description="Says what it is.")
    shiny_new_knob_s: float = Field(1.0)


def test_a_setting_without_a_description_is_refused(settings_doc: ModuleType) -> None:
    with pytest.raises(settings_doc.SettingsDocError, match="shiny_new_knob_s has no description"):
        settings_doc.render_section(Undocumented)
