"""What differs, as a client sees it, between the SGLang releases the simulator can imitate.

One :class:`VersionProfile` per release (``sglang-sim --sglang-version X``); the default is the deployed
release, :data:`thinkfleet.sglang_version.SGLANG_VERSION`. Every field was read from the published
wheel's source; docs/sglang-versions.md names the file and function of each.
"""

from __future__ import annotations

from dataclasses import dataclass

from thinkfleet.sglang_version import SGLANG_VERSION


@dataclass(frozen=True)
class VersionProfile:
    version: str
    #: ``meta_info`` key of the retraction count (tokenizer_manager._handle_batch_output).
    retractions_key: str
    #: ``meta_info.reasoning_tokens`` is present (from 0.5.10).
    reasoning_tokens: bool
    #: An unknown or mistyped sampling key: False → ``SamplingParams(**kw)`` raises TypeError, FastAPI
    #: answers 500 ``Internal Server Error`` (text/plain); True (0.5.22+) → the api/v1 JSON contract
    #: check in http_server.generate_request answers 400 ``{"error": "<serde message>"}``.
    sampling_contract: bool
    #: ``input + max_new_tokens >= context_len`` is refused (up to 0.5.10); False: only ``>`` (0.5.11+).
    context_check_inclusive: bool
    #: A rid repeated inside one batch (0.5.10+) or already in flight (0.5.11+) is refused with 400;
    #: False: accepted, and the earlier request's caller is never answered (its state is replaced).
    rejects_duplicate_rids: bool
    #: The streamed validation-error chunk carries ``type``/``code``/``retryable`` (0.5.21 has it,
    #: 0.5.12 does not); False: ``{"error": {"message": …}}`` only.
    detailed_stream_errors: bool
    #: ``GET /ready`` exists (0.5.21 has it).
    ready_route: bool
    #: ``/model_info`` also has served_model_name, load_format, reasoning_parser, tool_call_parser,
    #: disaggregation_mode (0.5.21 has them).
    model_info_extended: bool
    #: ``/server_info`` also has launch_command, startup_time, hicache_object_layout, kv_events,
    #: frontend; ``internal_states[].memory_usage.graph`` is a per-phase dict.
    server_info_extended: bool
    #: ``meta_info.cached_tokens_details`` (null without a hierarchical cache) after ``cached_tokens``.
    cached_tokens_details: bool = True
    #: With ``--enable-metrics``, ``meta_info`` carries the scheduler's timing keys (0.5.9's
    #: ``_add_metric_if_present`` / ``_calculate_timing_metrics``; 0.5.23's ``convert_to_output_meta_info`` of
    #: ``observability/req_time_stats.py``, flat keys of other names).
    timing_meta_info: bool = False
    #: Which release's ``meta_info`` keys ``responses.meta_info`` writes: "0.5.9", or "0.5.23" (also
    #: ``weight_versions``, ``dp_rank``, ``cached_tokens_details`` a dict once a prefix was cached).
    meta_info_layout: str = "0.5.9"
    #: Under ``--speculative-algorithm``, the finished ``meta_info``'s accepted-drafts, proposed-drafts and
    #: histogram keys (0.5.9 ``tokenizer_manager.py:1855-1865``; 0.5.23 renamed them, its ``:3170-3199``).
    spec_keys: tuple[str, str, str] = ("spec_accept_token_num", "spec_draft_token_num", "spec_accept_histogram")
    #: An image prompt's ids are kept (only its placeholders expanded; ``SGLANG_MM_AVOID_RETOKENIZE``, from 0.5.13)
    #: and ``return_prompt_token_ids`` answers them (``prompt_token_ids``); False: the field is not in the request
    #: (0.5.9's ``GenerateReqInput`` has no such field), nothing is returned.
    prompt_token_ids: bool = False
    #: More image placeholders than images: 400 (0.5.23 ``_placeholder_mismatch_error``, a ValueError); False: 500
    #: (0.5.9's RuntimeError from ``legacy_load_mm_data``). sglang_sim/vision.py.
    image_errors_400: bool = False


PROFILES: dict[str, VersionProfile] = {
    "0.5.9": VersionProfile(
        version="0.5.9",
        retractions_key="total_retractions",
        reasoning_tokens=False,
        sampling_contract=False,
        context_check_inclusive=True,
        rejects_duplicate_rids=False,
        detailed_stream_errors=False,
        ready_route=False,
        model_info_extended=False,
        server_info_extended=False,
        timing_meta_info=True,
    ),
    "0.5.23": VersionProfile(
        version="0.5.23",
        retractions_key="num_retractions",
        reasoning_tokens=True,
        sampling_contract=True,
        context_check_inclusive=False,
        rejects_duplicate_rids=True,
        detailed_stream_errors=True,
        ready_route=True,
        model_info_extended=True,
        server_info_extended=True,
        timing_meta_info=True,
        meta_info_layout="0.5.23",
        spec_keys=("spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_correct_drafts_histogram"),
        prompt_token_ids=True,
        image_errors_400=True,
    ),
}

#: ``--sglang-version`` choices.
SUPPORTED_VERSIONS: tuple[str, ...] = tuple(PROFILES)
DEFAULT_VERSION = SGLANG_VERSION
assert DEFAULT_VERSION in PROFILES, f"no simulator profile for the deployed SGLang {DEFAULT_VERSION}"


def profile(version: str) -> VersionProfile:
    try:
        return PROFILES[version]
    except KeyError:
        raise ValueError(f"sglang_version must be one of {', '.join(SUPPORTED_VERSIONS)}, got {version!r}") from None
