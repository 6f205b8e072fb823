"""Where the CLI finds the server and the API key: `--server`/`--api-key`, else
$CPN_SERVER/$CPN_API_KEY, else the config file ($CPN_CONFIG, default
~/.config/cpn/config.yaml) with `server:` and `api_key:`."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from cpn.contracts.loading import read_text
from cpn.errors import InputError

DEFAULT_SERVER = "http://127.0.0.1:8080"


class ClientConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    server: str = DEFAULT_SERVER
    api_key: str | None = None


def config_path() -> Path:
    return Path(os.environ.get("CPN_CONFIG") or Path.home() / ".config" / "cpn" / "config.yaml")


def load_config(server: str | None = None, api_key: str | None = None) -> ClientConfig:
    path = config_path()
    stored = ClientConfig()
    if path.exists():
        text = read_text(path)
        try:
            doc = yaml.safe_load(text) or {}
            stored = ClientConfig.model_validate(doc)
        except (yaml.YAMLError, ValidationError) as exc:
            first = str(exc).splitlines()[0]
            raise InputError(f"{path}: {first}") from None
    return ClientConfig(
        server=server or os.environ.get("CPN_SERVER") or stored.server,
        api_key=api_key or os.environ.get("CPN_API_KEY") or stored.api_key,
    )
