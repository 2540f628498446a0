"""The three actors of the paper's design (Figure 6), one module each, talking only over queues."""

from runahead.actors.fetcher import ExpertFetcher
from runahead.actors.issuer import JobIssuer
from runahead.actors.scheduler import ComputeScheduler, TokenSink

__all__ = ["ComputeScheduler", "ExpertFetcher", "JobIssuer", "TokenSink"]
