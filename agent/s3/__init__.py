"""Object stores (S3, MinIO, Ceph RGW, SeaweedFS) as sources and as publish destinations.

``address`` (pure: ``s3://BUCKET/PREFIX`` to HTTP URLs and keys), ``errors`` (pure: an S3 error
document in words, secrets never shown), ``auth`` (credentials from the AWS chain or a file the
policy names, SigV4 signatures: the only module of the pulls' path that imports botocore, lazily,
so that a node without s3:// sources never loads it) and ``upload`` (publishing to a bucket, over
botocore's client: parallel multipart uploads, resumed).
"""
