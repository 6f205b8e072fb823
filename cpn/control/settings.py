"""The control plane's settings: one pydantic-settings class, read from `CPN_*` variables
and overridden by `cpn serve`'s flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cpn.registry.db import DEFAULT_DATABASE_URL


class ControlSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CPN_", extra="ignore")

    database_url: str = DEFAULT_DATABASE_URL
    host: str = Field(default="0.0.0.0", description="address both servers listen on")
    grpc_port: int = Field(default=50051, ge=0, le=65535)
    http_port: int = Field(default=8080, ge=0, le=65535)
    site_tokens: Path | None = None
    lease_ttl_s: float = Field(default=10.0, gt=0, description="an agent silent this long is lost")
    heartbeat_interval_s: float = Field(default=3.0, gt=0, description="asked of agents")
    reaper_interval_s: float = Field(default=0.5, gt=0)
    flush_interval_s: float = Field(default=0.5, gt=0, description="heartbeat batch writes")
    max_message_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    tls_cert: Path | None = Field(default=None, description="PEM certificate chain (TLS)")
    tls_key: Path | None = Field(default=None, description="PEM private key (TLS)")

    @model_validator(mode="after")
    def _tls_pair(self) -> ControlSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        return self

    @model_validator(mode="after")
    def _heartbeat_fits_lease(self) -> ControlSettings:
        if self.heartbeat_interval_s >= self.lease_ttl_s:
            raise ValueError(
                f"heartbeat interval ({self.heartbeat_interval_s:g} s) must be shorter than "
                f"the lease TTL ({self.lease_ttl_s:g} s)"
            )
        return self
