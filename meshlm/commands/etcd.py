"""`meshlm etcd`: a local etcd of 1 or 3 members for control-plane replicas on one machine.
Member i serves clients on PORT+2i and peers on PORT+2i+1 (2379/2380 for one
member, as etcd's defaults); prints the --store URL for `meshlm xds-server` once every member is
healthy, and stops them on Ctrl-C. Loopback only.

Secure by default: TLS for clients and peers with certificates of a CA made for this cluster
(clients must show one of its certificates), and etcd's auth on, with a `meshlm` user whose role
may read and write /ROOT/ alone. The credentials are private files under the data dir
(creds/client/: CA, client certificate and key, user, password; creds/root-password for an
operator); the printed URL names that directory (`etcds://...?creds=DIR`), never a secret.
`--insecure` is plaintext without auth: anyone who reaches the port can rewrite the mesh."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from meshlm.signals import termination_event


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--members", type=int, choices=(1, 3), default=1,
                   help="cluster size (3 survives one member's loss)")  # fmt: skip
    p.add_argument("--port", type=int, default=2379,
                   help="client port of the first member (member i: PORT+2i, its peers "
                   "PORT+2i+1)")  # fmt: skip
    p.add_argument("--data-dir", help="keep the members' data (and credentials) here, across "
                   "runs (default: a temporary dir, removed at exit)")  # fmt: skip
    p.add_argument("--root", default="meshlm", help="the key prefix (/ROOT/) the meshlm user "
                   "may read and write (default meshlm)")  # fmt: skip
    p.add_argument("--insecure", action="store_true", help="plaintext HTTP and no auth: any "
                   "process that reaches the port can read and rewrite the mesh")  # fmt: skip
    o = p.add_argument_group("credentials for an etcd run elsewhere (deploy/kubernetes/)")
    o.add_argument("--make-creds", metavar="DIR", help="write a new CA, member and client "
                   "certificates and passwords to DIR (private files), then exit")  # fmt: skip
    o.add_argument("--san", action="append", default=[], metavar="DNS", help="with "
                   "--make-creds: a DNS name of the members (repeat it), besides localhost and "
                   "127.0.0.1")  # fmt: skip
    o.add_argument("--enable-auth", metavar="HOST:PORT[,...]", help="turn etcd's auth on at "
                   "these members (TLS with --creds' client certificate): a root user and a "
                   "meshlm user limited to /ROOT/, then exit")  # fmt: skip
    o.add_argument("--creds", metavar="DIR", help="with --enable-auth: the --make-creds DIR")


def _root_ok(root: str) -> bool:
    from xds_server.store.url import ROOT

    return bool(ROOT.match(root.strip("/")))


def _credentials(args: argparse.Namespace) -> int:
    """--make-creds or --enable-auth: one step of the setup deploy/kubernetes/README.md shows."""
    from xds_server.store.base import StoreError
    from xds_server.store.etcd_pki import EtcdPki
    from xds_server.store.local_etcd import enable_auth

    if args.make_creds:
        pki = EtcdPki(Path(args.make_creds)).make(args.san)
        print(f"etcd credentials: members {pki.members}, clients {pki.client} (a store URL's "
              f"creds=), root password {pki.root_password_file}", flush=True)  # fmt: skip
        return 0
    if not args.creds or not EtcdPki(Path(args.creds)).ready:
        print("meshlm etcd: --enable-auth needs --creds DIR (made by --make-creds)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        pki = EtcdPki(Path(args.creds))
        done = enable_auth(args.enable_auth.split(","), pki, args.root)
    except (StoreError, ValueError, OSError) as e:
        print(f"meshlm etcd: --enable-auth: {e}", file=sys.stderr)
        return 1
    print("etcd: auth " + ("enabled" if done else "was enabled already") +
          f": user meshlm may use /{args.root.strip('/')}/", flush=True)  # fmt: skip
    return 0


def run(args: argparse.Namespace) -> int:
    from xds_server.store.local_etcd import EtcdNotFound, LocalEtcd

    if args.make_creds or args.enable_auth:
        return _credentials(args)

    last = args.port + 2 * args.members - 1
    if args.port < 1 or last > 65535:
        print(f"meshlm etcd: --port: {args.members} member(s) need ports {args.port}-{last} "
              "within 1-65535", file=sys.stderr)  # fmt: skip
        return 2
    keep = args.data_dir is not None
    data = Path(args.data_dir) if keep else Path(tempfile.mkdtemp(prefix="meshlm-etcd-"))
    stop = termination_event()
    try:
        cluster = LocalEtcd(
            args.members,
            [args.port + 2 * i for i in range(args.members)],
            [args.port + 2 * i + 1 for i in range(args.members)],
            data,
            secure=not args.insecure,
            root=args.root,
        )
    except EtcdNotFound as e:
        print(f"meshlm etcd: {e}", file=sys.stderr)
        return 1
    code = 0
    if not _root_ok(args.root):
        print(f"meshlm etcd: --root {args.root!r}: letters, digits, . _ - and / only",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        cluster.start()
        cluster.wait_healthy()
        where = f"data in {data}" + ("" if keep else ", removed at exit")
        if args.insecure:
            print("meshlm etcd: warning: --insecure: plaintext, no auth: any process that "
                  "reaches these ports can rewrite the mesh", file=sys.stderr,
                  flush=True)  # fmt: skip
        print(f"etcd: {args.members} member(s) healthy on {', '.join(cluster.endpoints)} "
              f"({where}); Ctrl-C stops them", flush=True)  # fmt: skip
        print(f"store: {cluster.store_url()}", flush=True)
        print(f"replicas: meshlm xds-server --mesh MESH --store {cluster.store_url()} "
              f"--replicas 3", flush=True)  # fmt: skip
        while not stop.wait(0.5):
            if gone := cluster.exited():
                i, rc = gone[0]
                print(f"meshlm etcd: member m{i} exited ({rc}): {cluster.log_tail(i)}",
                      file=sys.stderr)  # fmt: skip
                code = 1
                break
    except (OSError, RuntimeError, ValueError) as e:  # a port in use, a member never healthy
        print(f"meshlm etcd: {e}", file=sys.stderr)
        code = 1
    finally:
        cluster.stop(signal.SIGTERM)  # etcd closes its data files cleanly on SIGTERM
        if not keep:
            shutil.rmtree(data, ignore_errors=True)
    if code == 0:
        print("etcd: stopped", flush=True)
    return code
