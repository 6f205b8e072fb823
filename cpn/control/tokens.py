"""Per-site bearer tokens (and the operator's site settings), from a YAML file.

The file maps each site name to its token, or to a mapping with the token and settings
that discovery cannot know:

    beijing: 3f9c...                      # just the token
    shanghai:
      token: 8d1e...
      gpu_price_per_hour: 2.2             # price of one GPU-hour at this site
      intra_site_gbps: 400                # bandwidth between nodes of the site

Tokens are looked up by their SHA-256 digest, so the lookup's timing says nothing about
how much of a guessed token was right.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, RootModel, StringConstraints, ValidationError

from cpn.contracts.limits import Gbps, Price
from cpn.contracts.loading import format_location, read_text
from cpn.errors import InputError
from cpn.registry.inventory import SiteSettings

SITE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
MIN_TOKEN_LENGTH = 8


class _SiteEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: Annotated[str, StringConstraints(min_length=MIN_TOKEN_LENGTH, max_length=512)]
    # The same bounds as the topology contract: these values become the scheduler's view.
    gpu_price_per_hour: Price = 0.0
    intra_site_gbps: Gbps | None = None


class _TokensFile(RootModel[dict[str, _SiteEntry]]):
    pass


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class SiteTokens:
    """Which site a token belongs to, and each site's operator settings."""

    by_digest: dict[bytes, str]
    settings: dict[str, SiteSettings]

    @classmethod
    def from_mapping(cls, data: Any, source: str = "site tokens") -> SiteTokens:
        if not isinstance(data, dict) or not data:
            raise InputError(f"{source}: expected a mapping of site name to token")
        normalised: dict[str, Any] = {}
        for key, value in data.items():
            name = str(key)
            if not re.fullmatch(SITE_NAME, name) or len(name) > 64:
                raise InputError(f"{source}: {name!r}: not a valid site name")
            normalised[name] = {"token": str(value)} if isinstance(value, str | int) else value
        try:
            parsed = _TokensFile.model_validate(normalised).root
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            where = format_location(tuple(err["loc"]))
            raise InputError(f"{source}: {where}: {err['msg'].lower()}") from None
        by_digest: dict[bytes, str] = {}
        for site, entry in parsed.items():
            digest = _digest(entry.token)
            if digest in by_digest:
                raise InputError(
                    f"{source}: {site}: same token as site {by_digest[digest]!r}; "
                    "each site needs its own"
                )
            by_digest[digest] = site
        settings = {
            site: SiteSettings(e.gpu_price_per_hour, e.intra_site_gbps)
            for site, e in parsed.items()
        }
        return cls(by_digest, settings)

    @classmethod
    def load(cls, path: Path) -> SiteTokens:
        text = read_text(path)
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            raise InputError(f"{path}: not valid YAML") from None
        return cls.from_mapping(data, str(path))

    def site_for(self, token: str) -> str | None:
        return self.by_digest.get(_digest(token))

    @property
    def sites(self) -> list[str]:
        return sorted(self.settings)
