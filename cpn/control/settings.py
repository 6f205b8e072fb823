"""`cpn serve`'s settings: one pydantic-settings class, the only place each default lives.

Values come, lowest to highest precedence, from these defaults, then `CPN_<FIELD>`
environment variables (`CPN_LEASE_TTL_S=20`), then `cpn serve`'s flags (a flag left out
is not passed, so it never hides the environment). The control server, the orchestration
loop and the REST API all read this one object.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cpn.registry.db import DEFAULT_DATABASE_URL


class ControlSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CPN_", extra="ignore")

    # ---------------------------------------------------------------- servers, database
    database_url: str = Field(
        default=DEFAULT_DATABASE_URL, description="sqlite:///path.db or postgresql://user@host/db"
    )
    host: str = Field(default="0.0.0.0", description="address both servers listen on")
    grpc_port: int = Field(default=50051, ge=0, le=65535, description="agent service (0: any)")
    http_port: int = Field(default=8080, ge=0, le=65535, description="REST API (0: any)")
    site_tokens: Path | None = Field(default=None, description="YAML: site → bearer token")
    tls_cert: Path | None = Field(default=None, description="PEM certificate chain (TLS)")
    tls_key: Path | None = Field(default=None, description="PEM private key (TLS)")
    log_level: str = Field(default="info", description="debug, info, warning, error")

    # ---------------------------------------------------------------- agents and leases
    lease_ttl_s: float = Field(default=10.0, gt=0, description="an agent silent this long is lost")
    heartbeat_interval_s: float = Field(default=3.0, gt=0, description="asked of agents")
    reaper_interval_s: float = Field(default=0.5, gt=0)
    restart_grace_s: float = Field(
        default=45.0,
        gt=0,
        description="after a restart, agents the database calls alive get this long (at "
        "least one lease TTL) to register again: agents retry with backoff up to 30 s, "
        "then need time to connect and register on a loaded machine",
    )
    flush_interval_s: float = Field(default=0.5, gt=0, description="heartbeat batch writes")
    order_poll_s: float | None = Field(
        default=None,
        gt=0,
        description="agents' order streams also look for new orders this often (orders "
        "written by another control plane on the same database); unset: only when this "
        "process queues one",
    )
    max_message_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="largest request accepted from an agent"
    )

    # ---------------------------------------------------------------- orchestration
    schedule_interval_s: float = Field(
        default=0.5, gt=0, description="the orchestration loop's tick when nothing wakes it"
    )
    plan_time_limit_s: float = Field(
        default=5.0, gt=0, description="solver budget for one admission attempt"
    )
    rendezvous_port_min: int = Field(
        default=29500, ge=1024, le=65535, description="lowest rendezvous port given to a job"
    )
    rendezvous_port_max: int = Field(
        default=29999, ge=1024, le=65535, description="highest rendezvous port given to a job"
    )
    stop_grace_s: float = Field(
        default=15.0,
        gt=0,
        description="after a stop order, GPUs are freed when every worker has ended or this "
        "many seconds have passed",
    )
    checkpoint_root: str | None = Field(
        default=None,
        description="a directory or fsspec URL every site reaches: jobs write checkpoints "
        "under ROOT/JOB/eEPOCH and resume from them after a loss (unset: no checkpoints)",
    )
    checkpoint_every: int = Field(
        default=50, ge=1, description="steps between checkpoints of a job that does not say"
    )
    restart_backoff_s: float = Field(
        default=2.0,
        ge=0,
        description="a job restarted after a worker failure waits this long, doubled at each "
        "restart (at most restart_backoff_max_s)",
    )
    restart_backoff_max_s: float = Field(default=300.0, ge=0)
    log_lines_kept: int = Field(
        default=2000, ge=10, le=1_000_000, description="worker output lines kept per rank"
    )
    quote_ttl_s: float = Field(default=600.0, gt=0, description="how long a quote can be used")
    api_key_cache_s: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="an accepted API key is not looked up again for this long, so a revoked "
        "key is refused at most this long after `cpn keys revoke` (0: look up every request)",
    )

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

    @model_validator(mode="after")
    def _port_range(self) -> ControlSettings:
        if self.rendezvous_port_min > self.rendezvous_port_max:
            raise ValueError(
                f"rendezvous ports: {self.rendezvous_port_min} > {self.rendezvous_port_max}"
            )
        return self
