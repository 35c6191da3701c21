"""An asyncio event loop in a daemon thread of its own, for grpc.aio servers that blocking code
starts and stops: the control plane's ADS server (xds_server/server.py) and a sidecar's
SDS server (sidecar/sds.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent import futures
from typing import TypeVar

T = TypeVar("T")
SETTLE_S = 1.0  # how long stop() lets tasks still running end by themselves before cancelling


class LoopThread:
    def __init__(self, name: str) -> None:
        # Made here, run in the thread: callers may hand it work (call_soon_threadsafe) as
        # soon as they hold it.
        self.loop = asyncio.new_event_loop()
        self._name = name
        self._thread: threading.Thread | None = None

    def start(self, boot: Callable[[], Awaitable[T]], timeout: float = 30.0) -> T:
        """Run `boot()` in the loop (bind and start servers there) and return its result once it
        is done; the loop then runs until stop(). If `boot` raises, so does this, and the
        thread ends with the loop closed."""
        ready: futures.Future[T] = futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(boot, ready), name=self._name, daemon=True
        )
        self._thread.start()
        return ready.result(timeout=timeout)

    def stop(self, shutdown: Callable[[], Awaitable[None]], timeout: float = 10.0) -> None:
        """Run `shutdown()` in the loop (stop servers there), cancel the tasks still left (a
        server's open streams) and wait for them, then end the loop and its thread."""

        async def run() -> None:
            await shutdown()
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            # A stopped gRPC server may still be finishing its calls' tasks: cancelling one
            # that awaits its handler makes grpc log "Exception not handled" with a traceback.
            if tasks:
                _, tasks = await asyncio.wait(tasks, timeout=SETTLE_S)
            for t in tasks:
                t.cancel()
            # Let the cancelled tasks finish before the loop goes away.
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread:
            self._thread.join(timeout=10)

    def _run(self, boot: Callable[[], Awaitable[T]], ready: futures.Future[T]) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            result = self.loop.run_until_complete(boot())
        except BaseException as e:
            ready.set_exception(e)
            self.loop.close()
            return
        ready.set_result(result)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()
