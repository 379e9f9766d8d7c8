"""The replica's network: pod IPs on loopback, Service IPs with a TCP forwarder (kube-proxy's
part), and the DNS names rewritten to those addresses.

Linux routes all of 127.0.0.0/8 to the loopback device, so every pod gets an address of its own
(`Addresses`) and keeps the ports of its manifest: two rollout pods both listen on :30000, as
they would in their own network namespaces. A Service with a cluster IP gets one
and a forwarder per port to the ready pods it selects (round robin), targetPort resolved by
number or by the container port's name. Headless Services (clusterIP: None) resolve to the pod
addresses, ``<hostname>.<subdomain>`` to one pod. No resolver is changed: the names are
replaced by addresses in everything a container reads (command, args, env, mounted files),
see `Rewriter`.
"""

from __future__ import annotations

import itertools
import random
import re
import socket
import threading
from dataclasses import dataclass, field
from typing import Callable


class Addresses:
    """Hands out loopback addresses in a /16 of its own (127.<net>.0.0, ``net`` drawn at random
    so that two replicas on one host, or one left over, do not share addresses): pods from
    127.<net>.0.1, Services from 127.<net>.200.1."""

    def __init__(self, net: int | None = None):
        self.net = random.SystemRandom().randrange(30, 250) if net is None else net
        self._pods = itertools.count(1)
        self._services = itertools.count(1)

    def pod(self) -> str:
        n = next(self._pods)
        return f"127.{self.net}.{n // 250}.{n % 250 + 1}"

    def service(self) -> str:
        n = next(self._services)
        return f"127.{self.net}.{200 + n // 250}.{n % 250 + 1}"


@dataclass
class Forwarder:
    """Accepts TCP connections on ``(ip, port)`` and pipes each to an endpoint from ``endpoints()``
    (a list of ``(ip, port)``; round robin; the connection is closed when there is none)."""

    ip: str
    port: int
    endpoints: Callable[[], list[tuple[str, int]]]
    _sock: socket.socket | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _turn: itertools.count = field(default_factory=itertools.count)

    def start(self) -> "Forwarder":
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.ip, self.port))
        s.listen(128)
        s.settimeout(0.5)
        self._sock = s
        threading.Thread(target=self._accept, name=f"svc-{self.ip}:{self.port}", daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            eps = self.endpoints()
            if not eps:
                client.close()  # no ready endpoint: the client sees a refused/closed connection
                continue
            target = eps[next(self._turn) % len(eps)]
            threading.Thread(target=self._pipe, args=(client, target), daemon=True).start()

    @staticmethod
    def _pipe(client: socket.socket, target: tuple[str, int]) -> None:
        try:
            upstream = socket.create_connection(target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        client.settimeout(None)

        def copy(src, dst):
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        t = threading.Thread(target=copy, args=(upstream, client), daemon=True)
        t.start()
        copy(client, upstream)
        t.join()
        client.close()
        upstream.close()

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()


def service_names(name: str, namespace: str) -> list[str]:
    """The DNS names of a Service, longest first (``name.ns.svc.cluster.local``, ``name.ns.svc``,
    ``name.ns``): the forms cluster DNS answers for, other than the bare name."""
    return [f"{name}.{namespace}.svc.cluster.local", f"{name}.{namespace}.svc", f"{name}.{namespace}"]


class Rewriter:
    """Rewrites the strings a container reads so they mean, on this host, what they mean in its pod.

    - absolute paths under the pod's mount paths -> the volume's directory (longest mount first);
      ``/tmp`` -> the pod's own tmp when no volume is mounted there;
    - ``127.0.0.1``, ``localhost``, ``0.0.0.0`` -> the pod's address (its own loopback);
    - DNS names of Services and of pods (``host.subdomain.ns.svc...``) -> their addresses.

    A path is matched only where one starts (not inside a word or a URL's host part) and only up
    to a path boundary, so ``/models`` never rewrites ``/modelsX`` and ``s3://b/tmp`` is kept.
    """

    def __init__(self, mounts: dict[str, str], pod_ip: str, names: dict[str, str]):
        self.mounts = sorted(mounts.items(), key=lambda kv: -len(kv[0]))
        self.pod_ip = pod_ip
        self.names = sorted(names.items(), key=lambda kv: -len(kv[0]))
        self._dirs = {m.rstrip("/"): d for m, d in self.mounts}
        alternatives = "|".join(re.escape(m) for m in sorted(self._dirs, key=len, reverse=True))
        # One pass, longest mount first: a replaced directory is never rewritten again.
        self._path_re = re.compile(r"(?<![\w.:/-])(" + alternatives + r")(?=/|$|[^\w.-])") if self._dirs else None
        self._name_re = [(re.compile(r"(?<![\w.-])" + re.escape(n) + r"(?![\w-]|\.[\w])"), ip) for n, ip in self.names]
        self._local_re = re.compile(r"(?<![\w.-])(127\.0\.0\.1|localhost|0\.0\.0\.0)(?![\w-]|\.[\w])")

    def __call__(self, text: str) -> str:
        for rx, ip in self._name_re:
            text = rx.sub(ip, text)
        text = self._local_re.sub(self.pod_ip, text)
        if self._path_re is not None:
            text = self._path_re.sub(lambda m: self._dirs[m.group(1)], text)
        return text
