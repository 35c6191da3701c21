"""How a replica reaches etcd: TLS (the CA to trust, a client certificate) and etcd's own auth
(a user and its password), as a store URL names them.

  etcds://HOST:PORT[,HOST:PORT...][/ROOT]?creds=DIR
  etcds://HOST:PORT[/ROOT]?ca=FILE&cert=FILE&key=FILE&user=NAME&password_file=FILE

`creds=DIR` is what `meshlm etcd` writes: DIR/ca.pem, DIR/client.pem, DIR/client-key.pem,
DIR/user and DIR/password (0600); a parameter given beside it wins. The URL names files only:
no secret is ever on a command line, where `ps` shows it. Without `password_file` (nor one in
DIR) the password comes from $MESHLM_ETCD_PASSWORD. `etcd://` is plaintext HTTP; `user` and a
password work there too, but the password then crosses the network in the clear.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

PASSWORD_ENV = "MESHLM_ETCD_PASSWORD"
PARAMS = {"creds", "ca", "cert", "key", "user", "password_file"}
CREDS_FILES = {"ca": "ca.pem", "cert": "client.pem", "key": "client-key.pem"}


@dataclass(frozen=True)
class EtcdAccess:
    tls: ssl.SSLContext | None = None
    user: str | None = None
    password: str | None = None

    @property
    def secure(self) -> bool:
        return self.tls is not None and self.user is not None


def parse_access(query: str, *, tls: bool) -> EtcdAccess:
    """The access a URL's query names; ValueError names the parameter or file that is wrong."""
    params = {}
    for name, values in parse_qs(query, keep_blank_values=True, strict_parsing=bool(query)).items():
        if name not in PARAMS:
            raise ValueError(f"unknown parameter {name!r} (known: {', '.join(sorted(PARAMS))})")
        if len(values) != 1 or not values[0]:
            raise ValueError(f"parameter {name!r}: expected one non-empty value")
        params[name] = values[0]
    creds = Path(params["creds"]) if "creds" in params else None
    if creds is not None:
        if not creds.is_dir():
            raise ValueError(f"creds={creds}: not a directory")
        for name, file in CREDS_FILES.items():
            if (creds / file).exists():
                params.setdefault(name, str(creds / file))
        if "user" not in params and (creds / "user").exists():
            params["user"] = _read(creds / "user", "creds user").strip()
        if "password_file" not in params and (creds / "password").exists():
            params["password_file"] = str(creds / "password")
    context = None
    if tls:
        try:
            context = ssl.create_default_context(cafile=params.get("ca"))
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"ca={params.get('ca')}: {e}") from None
        if ("cert" in params) != ("key" in params):
            raise ValueError("cert and key: give both (the client certificate and its key)")
        if "cert" in params:
            try:
                context.load_cert_chain(params["cert"], params["key"])
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"cert={params['cert']}, key={params['key']}: {e}") from None
    elif {"ca", "cert", "key"} & set(params) - {"creds"}:
        raise ValueError("ca, cert and key need TLS: an etcds:// URL")
    user = params.get("user")
    password = None
    if user is not None:
        if "password_file" in params:
            password = _read(Path(params["password_file"]), "password_file").strip()
        else:
            password = os.environ.get(PASSWORD_ENV)
        if not password:
            raise ValueError(f"user {user!r}: no password (password_file=FILE or ${PASSWORD_ENV})")
    elif "password_file" in params:
        raise ValueError("password_file without a user")
    return EtcdAccess(context, user, password)


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror or e}") from None
