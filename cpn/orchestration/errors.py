"""What the job service refuses, and why. The REST layer maps each to its status code;
every message is one line naming the field, the quota or the shortfall."""

from __future__ import annotations

from cpn.errors import CpnError


class ServiceError(CpnError):
    """Base of the refusals below."""


class NotFound(ServiceError):
    """No such job or quote for this tenant (another tenant's looks the same: 404)."""


class InvalidRequest(ServiceError):
    """A field is wrong in a way the schema cannot see (422); the message names it."""


class NeverFits(ServiceError):
    """The job cannot fit on the network even with every GPU free (422, the shortfall)."""


class QuotaExceeded(ServiceError):
    """The tenant's GPU quota would be exceeded (403, the quota named)."""


class Conflict(ServiceError):
    """The request contradicts the state (409): an Idempotency-Key reused for another
    body, a cancel of a job already ended."""


class Unauthorized(ServiceError):
    """No API key, or one that is unknown or revoked (401)."""
