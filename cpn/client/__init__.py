"""A small typed client for cpn's REST API, used by the CLI and the tests.

    from cpn.client import CpnClient
    with CpnClient("http://127.0.0.1:8080", api_key) as cpn:
        job = cpn.submit(spec, idempotency_key="run-42")
        for line in cpn.follow_logs(job.id):
            print(line.line)

Responses are the API's own schemas (api.job_schemas, api.quote_schemas); a refusal
raises `ApiError` with the status and the server's one-line reason.
"""

from cpn.client.client import ApiError, CpnClient
from cpn.client.config import ClientConfig, load_config

__all__ = ["ApiError", "ClientConfig", "CpnClient", "load_config"]
