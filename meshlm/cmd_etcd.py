"""`meshlm etcd`: a local etcd of 1 or 3 members for control-plane replicas on one machine
(issue 15). Member i serves clients on PORT+2i and peers on PORT+2i+1 (2379/2380 for one
member, as etcd's defaults); prints the --store URL for `meshlm xds-server` once every member is
healthy, and stops them on Ctrl-C. Loopback only, plaintext, no auth: not for production."""

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
    p.add_argument("--data-dir", help="keep the members' data here, across runs (default: a "
                   "temporary dir, removed at exit)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from xds_server.store.local_etcd import EtcdNotFound, LocalEtcd

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
        )
    except EtcdNotFound as e:
        print(f"meshlm etcd: {e}", file=sys.stderr)
        return 1
    code = 0
    try:
        cluster.start()
        cluster.wait_healthy()
        where = f"data in {data}" + ("" if keep else ", removed at exit")
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
    except (OSError, RuntimeError) as e:  # a port in use, a member that never got healthy
        print(f"meshlm etcd: {e}", file=sys.stderr)
        code = 1
    finally:
        cluster.stop(signal.SIGTERM)  # etcd closes its data files cleanly on SIGTERM
        if not keep:
            shutil.rmtree(data, ignore_errors=True)
    if code == 0:
        print("etcd: stopped", flush=True)
    return code
