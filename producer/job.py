"""The job record, as the producer writes it: re-exported from ``thinkfleet.state.job``, its one home.

Kept so ``from producer.job import JobRecord`` goes on working; new code imports
``thinkfleet.state.job``.
"""

from thinkfleet.state.job import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    MAX_SKIPPED_RECORDS,
    JobRecord,
    sample_overrides,
    sampling_params,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
    "MAX_SKIPPED_RECORDS",
    "JobRecord",
    "sample_overrides",
    "sampling_params",
]
