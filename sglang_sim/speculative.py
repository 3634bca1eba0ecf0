"""Speculative decoding as a client sees it: the per-request acceptance figures of a finished ``meta_info``.

A real server started with ``--speculative-algorithm`` (EAGLE, EAGLE3, …) has a draft model propose
``speculative_num_draft_tokens - 1`` tokens per step, which the target verifies at once: the accepted drafts
plus one token of the target's own are emitted per *verify step*. The first output id comes from the prefill,
not from a verify step. Once a request finishes, SGLang 0.5.9 adds to its ``meta_info``
(``managers/tokenizer_manager.py:1825-1867``, ``TokenizerManager._calculate_spec_decoding_metrics``; the
counters are kept per request in ``managers/scheduler_output_processor_mixin.py:357-361``):

- ``spec_accept_rate`` = accepted drafts / proposed drafts; ``spec_accept_length`` = completion tokens / steps;
- ``spec_accept_token_num`` (accepted drafts), ``spec_draft_token_num`` (steps × (draft tokens − 1)),
  ``spec_verify_ct`` (steps);
- ``spec_accept_histogram``: how many steps accepted 0, 1, 2, … drafts (``schedule_batch.py:866``);

all only when at least one verify step ran. 0.5.23 names the two counts ``spec_num_correct_drafts`` and
``spec_num_proposed_drafts`` and the histogram ``spec_correct_drafts_histogram`` (its
``tokenizer_manager.py:3138-3210``); :class:`sglang_sim.versions.VersionProfile` says which.

The simulator has no draft model: whether a draft token is accepted is a deterministic function of the output
id it had to guess and the one before it (:func:`accepted`), at ``--speculative-accept-rate`` on average. The
same output always gets the same figures, and two outputs differ as two samples would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: ``--speculative-algorithm`` choices of 0.5.9 (``server_args.py`` ``--speculative-algorithm``); NEXTN is
#: reported as EAGLE, as ``ServerArgs._handle_speculative_decoding`` rewrites it.
ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
#: (num_steps, eagle_topk, num_draft_tokens) when none is given: ``auto_choose_speculative_params``' value for
#: every architecture but Llama and Grok (Kimi-K2.5's included).
DEFAULT_PARAMS = (3, 1, 4)


@dataclass(frozen=True)
class SpecFigures:
    """One finished request's acceptance figures (``verify_ct`` 0: no verify step ran, nothing is reported)."""

    verify_ct: int
    accepted: int  # accepted draft tokens (bonus tokens excluded)
    proposed: int  # verify_ct × (num_draft_tokens − 1)
    histogram: list[int]  # histogram[a] = verify steps that accepted a drafts
    completion_tokens: int

    def meta_info(self, keys: tuple[str, str, str]) -> dict[str, Any]:
        """The ``meta_info`` keys in SGLang's order; ``keys`` names the accepted/proposed/histogram ones."""
        if self.verify_ct <= 0 or self.proposed <= 0:
            return {}
        accepted_key, proposed_key, histogram_key = keys
        out: dict[str, Any] = {
            "spec_accept_rate": self.accepted / self.proposed,
            "spec_accept_length": self.completion_tokens / self.verify_ct,
            accepted_key: self.accepted,
            proposed_key: self.proposed,
            "spec_verify_ct": self.verify_ct,
        }
        if any(self.histogram):
            out[histogram_key] = list(self.histogram)
        return out


def accepted(previous: int, token: int, rate: float) -> bool:
    """Did the draft guess ``token`` (following ``previous``)? A fixed hash of the pair against ``rate``."""
    mixed = (previous * 0x9E3779B1 ^ token * 0x85EBCA77 ^ 0x27D4EB2F) & 0xFFFFFFFF
    mixed = ((mixed ^ (mixed >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    return (mixed ^ (mixed >> 12)) / 2**32 < rate


def figures(output_ids: list[int], num_draft_tokens: int, rate: float) -> SpecFigures:
    """Walk ``output_ids`` as verify steps of ``num_draft_tokens - 1`` drafts: a step accepts drafts while each
    is guessed (:func:`accepted`), then emits one token of the target's; the prefill emitted the first id."""
    k = max(0, num_draft_tokens - 1)
    n = len(output_ids)
    pos, steps, total = 1, 0, 0
    histogram: list[int] = []
    while pos < n:
        a = 0
        while a < k and pos + a < n - 1 and accepted(output_ids[pos + a - 1], output_ids[pos + a], rate):
            a += 1
        if len(histogram) <= a:
            histogram.extend([0] * (a + 1 - len(histogram)))
        histogram[a] += 1
        steps += 1
        total += a
        pos += a + 1
    return SpecFigures(steps, total, steps * k, histogram, n)
