"""S3 and Pod Identity for the replica: moto's S3 server, and an agent that hands out
credentials to the service accounts that have a Pod Identity association.

EKS Pod Identity gives a pod of an associated service account two variables (EKS user guide,
"How EKS Pod Identity works"; AWS SDKs reference, "Container credential provider"):
``AWS_CONTAINER_CREDENTIALS_FULL_URI`` (the node's agent) and
``AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`` (a projected service-account token). The SDK GETs
the URI with the token's contents as the ``Authorization`` header and receives
``{AccessKeyId, SecretAccessKey, Token, Expiration}``. `PodIdentityAgent` answers the same way
for the tokens it issued, and 401 for any other, so a pod whose service account has no
association gets no credentials, as on EKS. botocore accepts plain http for a loopback agent.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN_PATH = "/var/run/secrets/pods.eks.amazonaws.com/serviceaccount/eks-pod-identity-token"


class PodIdentityAgent:
    """Credentials for associated service accounts on ``http://<ip>:<port>/v1/credentials``.

    Args:
        ip: loopback address to listen on.
        associations: service-account names that have an association (infra: the trainer's and
            the rollout's).
    """

    def __init__(self, ip: str, associations: set[str]):
        self.associations = set(associations)
        self._tokens: dict[str, str] = {}  # token -> service account
        self.calls: dict[str, int] = {}  # service account -> credential requests served
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                sa = agent._tokens.get(self.headers.get("Authorization", ""))
                if self.path != "/v1/credentials" or sa is None:
                    self.send_response(401)
                    self.end_headers()
                    return
                agent.calls[sa] = agent.calls.get(sa, 0) + 1
                body = json.dumps({
                    "AccessKeyId": f"ASIA{sa.upper().replace('-', '')[:12]}",
                    "SecretAccessKey": "replica-secret", "Token": f"replica-session-{sa}",
                    "AccountId": "000000000000",
                    "Expiration": (datetime.now(timezone.utc) + timedelta(hours=6)).strftime("%Y-%m-%dT%H:%M:%SZ"),
                }).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet
                pass

        self._server = ThreadingHTTPServer((ip, 0), Handler)
        self.url = f"http://{ip}:{self._server.server_address[1]}/v1/credentials"
        threading.Thread(target=self._server.serve_forever, name="pod-identity", daemon=True).start()

    def token_for(self, service_account: str) -> str | None:
        """A new token for a pod of ``service_account``; None without an association."""
        if service_account not in self.associations:
            return None
        token = secrets.token_hex(16)
        self._tokens[token] = service_account
        return token

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class MotoS3:
    """moto's S3 server (ThreadedMotoServer) on a loopback port, with the bucket created."""

    def __init__(self, bucket: str, region: str):
        # moto: the test extra; boto3 with it
        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=self.url, region_name=region, aws_access_key_id="admin",
                              aws_secret_access_key="admin")
        kw = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        client.create_bucket(Bucket=bucket, **kw)

    def stop(self) -> None:
        self._server.stop()
