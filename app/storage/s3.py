"""Amazon S3 (or any S3 API, e.g. moto in tests) as the object store, through boto3.

Objects are atomic per key: a PutObject or a CompleteMultipartUpload makes the whole object
visible at once, so no reader sees a half-written file. Large files go up in parts through
boto3's managed transfer (TransferConfig). Optional server-side encryption: "AES256" (SSE-S3)
or "aws:kms" with a KMS key id (SSE-KMS).
API: https://boto3.amazonaws.com/v1/documentation/api/latest/guide/s3.html
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError, EndpointConnectionError

from app.storage.file import TMP_MARK
from app.storage.store import check_range, ObjectStore, check_key, check_prefix

MiB = 1 << 20
SSE_CHOICES = (None, "AES256", "aws:kms")


def _not_found(e: ClientError) -> bool:
    return e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound", "NoSuchBucket")


class S3Store(ObjectStore):
    """Objects under s3://bucket/prefix/.

    Args:
        bucket: bucket name.
        prefix: key prefix inside the bucket ('' for the bucket root).
        endpoint_url: S3 endpoint; default from $AWS_ENDPOINT_URL_S3, then $AWS_ENDPOINT_URL,
            then AWS's own.
        region: AWS region; default from the environment / profile.
        sse: None, "AES256" or "aws:kms"; default from $MOERL_S3_SSE.
        kms_key_id: KMS key id or ARN for "aws:kms"; default from $MOERL_S3_KMS_KEY_ID.
        multipart_threshold: bytes; larger files are uploaded in parts (S3's minimum part is 5 MiB).
        multipart_chunksize: bytes per part.
        check: look the bucket up now, so a wrong bucket or endpoint fails before any work.
    Raises:
        ValueError: a bad sse / kms_key_id combination.
        FileNotFoundError: the bucket does not exist (check=True).
        PermissionError: access to the bucket is denied (check=True).
        ConnectionError: the endpoint cannot be reached (check=True).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        sse: str | None = None,
        kms_key_id: str | None = None,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 16 * MiB,
        check: bool = True,
    ):
        sse = sse if sse is not None else (os.environ.get("MOERL_S3_SSE") or None)
        kms_key_id = kms_key_id if kms_key_id is not None else (os.environ.get("MOERL_S3_KMS_KEY_ID") or None)
        if sse not in SSE_CHOICES:
            raise ValueError(f"sse must be one of {SSE_CHOICES}, got {sse!r}")
        if kms_key_id and sse != "aws:kms":
            raise ValueError("kms_key_id is only valid with sse='aws:kms'")
        if prefix:
            check_key(prefix, "s3 prefix")
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.endpoint_url = (endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                             or os.environ.get("AWS_ENDPOINT_URL") or None)
        self.client = boto3.client("s3", endpoint_url=self.endpoint_url, region_name=region)
        self.extra: dict[str, str] = {}
        if sse:
            self.extra["ServerSideEncryption"] = sse
        if kms_key_id:
            self.extra["SSEKMSKeyId"] = kms_key_id
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold,
                                       multipart_chunksize=multipart_chunksize)
        if check:
            self._check_bucket()

    def _check_bucket(self) -> None:
        where = f"s3 bucket {self.bucket!r} (endpoint {self.endpoint_url or 'AWS default'})"
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if _not_found(e):
                raise FileNotFoundError(f"{where} does not exist") from None
            if code in ("403", "AccessDenied"):
                raise PermissionError(f"{where}: access denied") from None
            raise
        except EndpointConnectionError as e:
            raise ConnectionError(f"{where}: cannot connect: {e}") from None

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_file(self, local_path, key):
        if not Path(local_path).is_file():
            raise FileNotFoundError(f"put_file: {local_path} is not a file")
        self.client.upload_file(str(local_path), self.bucket, self._key(key),
                                ExtraArgs=self.extra or None, Config=self.transfer)

    def get_file(self, key, local_path):
        dst = Path(local_path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=TMP_MARK + dst.name + ".")
        os.close(fd)
        try:
            self.client.download_file(self.bucket, self._key(key), tmp, Config=self.transfer)
            os.replace(tmp, dst)
        except ClientError as e:
            Path(tmp).unlink(missing_ok=True)
            if _not_found(e):
                raise FileNotFoundError(f"{self.uri(key)}: no such object") from None
            raise
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return dst

    def put_bytes(self, key, data):
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=bytes(data), **self.extra)

    def get_bytes(self, key):
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as e:
            if _not_found(e):
                raise FileNotFoundError(f"{self.uri(key)}: no such object") from None
            raise

    def get_range(self, key, offset, length):
        if offset < 0 or length < 0:
            raise ValueError(f"{self.uri(key)}: bad range {offset}+{length}")
        if length == 0:
            return b""
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key),
                                          Range=f"bytes={offset}-{offset + length - 1}")["Body"].read()
        except ClientError as e:
            if _not_found(e):
                raise FileNotFoundError(f"{self.uri(key)}: no such object") from None
            raise
        check_range(self.uri(key), offset, length, len(body))
        return body

    def exists(self, key):
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as e:
            if _not_found(e):
                return False
            raise

    def list(self, prefix=""):
        check_prefix(prefix)
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            keys += [obj["Key"][strip:] for obj in page.get("Contents", [])]
        return sorted(keys)

    def delete_prefix(self, prefix):
        if not prefix:
            raise ValueError("delete_prefix: prefix must be non-empty")
        keys = self.list(prefix)
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._key(k)} for k in keys[start:start + 1000]]
            resp = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if resp.get("Errors"):
                err = resp["Errors"][0]
                raise OSError(f"{self.uri(err['Key'])}: delete failed: {err.get('Code')} {err.get('Message')}")
        return len(keys)
