"""The site tokens file of `cpn serve --site-tokens`."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpn.control import SiteTokens
from cpn.errors import InputError
from cpn.registry import SiteSettings


def test_plain_and_detailed_entries(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(
        "beijing: aaaaaaaaaaaa\n"
        "shanghai: {token: bbbbbbbbbbbb, gpu_price_per_hour: 2.2, intra_site_gbps: 400}\n"
    )
    tokens = SiteTokens.load(path)
    assert tokens.sites == ["beijing", "shanghai"]
    assert tokens.site_for("aaaaaaaaaaaa") == "beijing"
    assert tokens.site_for("bbbbbbbbbbbb") == "shanghai"
    assert tokens.site_for("aaaaaaaaaaa") is None
    assert tokens.settings["shanghai"] == SiteSettings(2.2, 400.0)
    assert tokens.settings["beijing"] == SiteSettings(0.0, None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected a mapping of site name to token"),
        ("- a\n- b\n", "expected a mapping"),
        ("a: aaaaaaaaaa\nb: aaaaaaaaaa\n", "b: same token as site 'a'"),
        ("a: short\n", "a.token: string should have at least 8 characters"),
        ("'bad site': aaaaaaaaaa\n", "'bad site': not a valid site name"),
        ("a: {token: aaaaaaaaaa, colour: red}\n", "a.colour: extra inputs are not permitted"),
        (
            "a: {token: aaaaaaaaaa, gpu_price_per_hour: -1}\n",
            "a.gpu_price_per_hour: input should be greater than or equal to 0",
        ),
        (
            "a: {token: aaaaaaaaaa, intra_site_gbps: .inf}\n",
            "a.intra_site_gbps: input should be a finite number",
        ),
        (
            "a: {token: aaaaaaaaaa, gpu_price_per_hour: 1e300}\n",
            "a.gpu_price_per_hour: input should be less than or equal to 1000000",
        ),
        ("a: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_files_get_one_line_naming_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SiteTokens.load(path)


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"nope\.yaml: no such file$"):
        SiteTokens.load(tmp_path / "nope.yaml")
