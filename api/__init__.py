"""The service layer's HTTP API (FastAPI). This issue adds `GET /v1/sites`; the service
issue adds jobs, quotes and the rest to the same app (`create_app`)."""

from api.main import create_app

__all__ = ["create_app"]
