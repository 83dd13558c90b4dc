"""The versioned weight channel: the trainer publishes snapshots, rollout workers fetch the latest.

Bulk bytes only: the broker announces version numbers separately; a worker that hears of version v
calls `WeightFetcher.fetch(min_version=v)` and gets the newest version the publisher holds.
"""

from vime.weights.fetcher import FetchedWeights, WeightFetcher, WeightFetchError
from vime.weights.publisher import PublishStats, WeightPublisher

__all__ = ["FetchedWeights", "PublishStats", "WeightFetchError", "WeightFetcher", "WeightPublisher"]
