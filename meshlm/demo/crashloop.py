"""Kubernetes' CrashLoopBackOff for a restarted process: a runtime that keeps dying (a query of
death, a bad flag) is not reloaded every few seconds, which would eat the CPU its healthy
neighbours serve with; one that ran a while before dying is restarted promptly again."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CrashLoopBackoff:
    """The first restart comes `initial` s after an exit, each next one twice the last, at most
    `cap`; an exit after a run of `stable` s or more starts over at `initial`."""

    initial: float = 1.0
    cap: float = 60.0
    stable: float = 120.0
    delay: float = 0.0  # the last one; 0 before the first exit

    def after_exit(self, ran_for: float) -> float:
        """The delay before restarting a process that exited after running `ran_for` s."""
        if not self.delay or ran_for >= self.stable:
            self.delay = self.initial
        else:
            self.delay = min(self.cap, self.delay * 2)
        return self.delay
