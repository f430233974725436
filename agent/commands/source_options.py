"""The options that say how to reach a source, shared by `wagent pull` and `wagent publish`:
TLS, proxy and credentials for any source; endpoint, region, profile and addressing for
``s3://BUCKET/PREFIX`` (``--endpoint-url`` as the AWS CLI has it)."""

from __future__ import annotations

import argparse

from agent.policy.model import Source
from agent.s3.address import ADDRESSING, check_endpoint, is_s3, split_s3


def add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca-bundle", metavar="FILE", help="PEM CA bundle for TLS (verification is "
                                                       "always on)")
    p.add_argument("--proxy", metavar="URL", help="HTTP proxy for every source")
    p.add_argument("--credentials", metavar="FILE",
                   help="file holding 'bearer TOKEN' or 'basic USER:PASSWORD'; for s3:// an AWS "
                        "shared credentials file readable by its owner only (never logged)")
    g = p.add_argument_group("s3:// sources (default: AWS, credentials from the AWS chain)")
    g.add_argument("--endpoint-url", metavar="URL",
                   help="the S3 API's URL: MinIO, Ceph RGW, SeaweedFS, e.g. http://minio:9000")
    g.add_argument("--region", help="SigV4's region (default: the AWS config's, else us-east-1)")
    g.add_argument("--profile", help="the profile of the AWS shared files")
    g.add_argument("--addressing", choices=ADDRESSING, default="auto",
                   help="bucket in the path or in the host name (default: path on an endpoint, "
                        "virtual-host on AWS)")


def source_of(url: str, args: argparse.Namespace) -> Source:
    """The Source ``url`` names with these options; ValueError with the reason."""
    if is_s3(url):
        split_s3(url)
        if args.endpoint_url:
            check_endpoint(args.endpoint_url)
        return Source(url, proxy=args.proxy, ca_bundle=args.ca_bundle,
                      credentials=args.credentials, endpoint=args.endpoint_url,
                      region=args.region, addressing=args.addressing, profile=args.profile)
    if args.endpoint_url or args.region or args.profile or args.addressing != "auto":
        raise ValueError(f"--endpoint-url, --region, --profile and --addressing are for s3:// "
                         f"sources, not {url!r}")
    return Source(url, proxy=args.proxy, ca_bundle=args.ca_bundle, credentials=args.credentials)
