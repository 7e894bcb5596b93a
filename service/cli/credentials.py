"""`trainmedic credentials node|job NAME`: a Redis user for one node agent or one training job."""
from __future__ import annotations

import argparse
from typing import Any

from ...client.wire.keys import TARGET_NAME_RE, Target

from ..settings import ServiceSettings
from .common import CliError, UsageError


def add(sub: Any) -> None:
    p = sub.add_parser("credentials", help="create or rotate the Redis user of one node agent or training job")
    p.add_argument("kind", choices=("node", "job"), help="a node agent or a training job")
    p.add_argument("name", metavar="NAME", help="the node's or job's name, as alerts name it")
    p.add_argument("--redis-url", help="a Redis URL whose user may run ACL SETUSER (default: TRAINMEDIC_REDIS_URL)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace, settings: ServiceSettings) -> int:
    import redis

    from ...client.wire.redis import connect, redis_url
    from ..credentials import issue, user_name

    if not TARGET_NAME_RE.match(args.name):
        raise UsageError("NAME must be 1 to 128 letters, digits or _.:@-")
    try:
        url = redis_url(args.redis_url or settings.redis_url)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    target = Target(args.kind, args.name)
    r = connect(url)
    try:
        made = issue(r, url, target)
    except redis.exceptions.NoPermissionError:
        raise CliError("this Redis user may not create users (ACL SETUSER): pass --redis-url with an admin "
                       "user's URL") from None
    except redis.RedisError as exc:
        raise CliError(f"cannot create the user in Redis ({type(exc).__name__}: {exc})") from None
    finally:
        r.close()
    print(f"# Redis user {user_name(target)}: only {target.label}'s own keys; its old password, if any, no longer "
          "works.")
    print("# ACL line (for an ACL file):" + ("" if not made.saved else " already saved with ACL SAVE"))
    print(made.acl_line)
    print(f"# Hand this to the {'node agent' if target.kind == 'node' else 'training job'} (keep it secret):")
    print(f"TRAINMEDIC_REDIS_URL={made.redis_url}")
    return 0
