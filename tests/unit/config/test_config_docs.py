"""Every config key is documented in docs/guides/config.md, and the file is what the schema generates."""

from __future__ import annotations

from astrai.config.docs import iter_keys, render_reference
from tests.conftest import REPO


def test_config_reference_is_up_to_date():
    written = (REPO / "docs/guides/config.md").read_text()
    assert written == render_reference(), "regenerate: python -m astrai config-docs > docs/guides/config.md"


def test_every_key_has_a_description_and_a_row():
    written = (REPO / "docs/guides/config.md").read_text()
    for dotted, field in iter_keys():
        assert field.description, f"{dotted} has no description in the schema"
        assert f"`{dotted}`" in written, f"{dotted} missing from docs/guides/config.md"
