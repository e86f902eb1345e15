"""Every setting is listed, with a comment, in .env.example, and named in the README."""

from __future__ import annotations

import re
from pathlib import Path

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_is_in_env_example_with_a_comment_and_in_the_readme() -> None:
    env_lines = (ROOT / ".env.example").read_text().splitlines()
    readme = (ROOT / "README.md").read_text()
    for field in Settings.model_fields:
        name = field.upper()
        index = next((i for i, line in enumerate(env_lines) if re.match(rf"{name}=", line)), None)
        assert index is not None, f"{name} is missing from .env.example"
        assert index > 0 and env_lines[index - 1].startswith("#"), f"{name} has no comment in .env.example"
        assert f"`{name}`" in readme, f"{name} is not in the README's configuration table"
