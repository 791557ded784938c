"""Scheduling POLICY: who runs each step and with how many tokens. No torch, no clock (`now` is passed in)."""

from tandem.sched.scheduler import Scheduler

__all__ = ["Scheduler"]
