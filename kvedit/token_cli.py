"""`kvedit http-token`: print the HTTP bearer token of a kvedit server's secret.

Why: HTTP never carries the secret itself (kvedit.auth.http_token); a person with curl needs
the token derived from it: `curl -H "Authorization: Bearer $(kvedit http-token --port
6555)" http://127.0.0.1:8080/status`. Reads the secret as a client would (kvedit.auth).
"""
from __future__ import annotations

import sys

from kvedit import auth


def register(sub) -> None:
    p = sub.add_parser("http-token", help="print the HTTP bearer token of a server's secret",
                       description=__doc__.splitlines()[0])
    p.add_argument("--secret-file", default=None,
                   help="the server's secret file (else $KVEDIT_SECRET / $KVEDIT_SECRET_FILE, "
                        "else the secret a server on --port made in this user's runtime "
                        "directory)")
    p.add_argument("--port", type=int, default=6555,
                   help="ZMQ port of a loopback server that made its own secret (default 6555)")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        secret = auth.load_secret(secret_file=args.secret_file,
                                  url=f"tcp://127.0.0.1:{args.port}")
    except auth.AuthError as e:
        print(f"kvedit http-token: {e}", file=sys.stderr)
        return 2
    if secret is None:
        print(f"kvedit http-token: no secret: give --secret-file, or set $KVEDIT_SECRET_FILE; "
              f"no server on port {args.port} left one in this user's runtime directory",
              file=sys.stderr)
        return 2
    print(auth.http_token(secret))
    return 0
