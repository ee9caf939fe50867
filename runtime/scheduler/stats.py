"""The scheduler's counters and gauges as one flat dict (Prometheus-style names)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.scheduler.scheduler import Scheduler


def scheduler_stats(s: Scheduler) -> dict[str, float]:
    """A scheduler's counters and gauges, Prometheus-style names (/metrics, Engine.stats)."""
    c, cache = s.counters, s.kv.cache
    computed, cached = c["prefill_tokens"], c["cached_tokens"]
    return {
        "prefill_tokens_total": computed,
        "decode_tokens_total": c["decode_tokens"],
        "cached_tokens_total": cached,
        "cache_hit_rate": cached / (cached + computed) if cached + computed else 0.0,
        "evicted_tokens_total": cache.num_evicted_tokens,
        "retractions_total": c["retractions"],
        "share_retractions_total": c["share_retractions"],
        "prefill_waits_total": c["prefill_waits"],
        "disk_waits_total": c["disk_waits"],
        "admissions_held_total": c["admissions_held"],
        "programs_entered_total": c["programs_entered"],
        "programs_entered_priced_total": c["programs_entered_priced"],
        "program_entries_deferred_total": c["program_entries_deferred"],
        "requests_finished_total": c["finished"],
        "requests_aborted_total": c["aborted"],
        "requests_failed_total": c["errors"],
        "steps_total": c["steps"],
        "num_running": len(s.running),
        "num_waiting": len(s.waiting),
        "num_pins": len(s.pins),
        "kv_slots_total": s.kv.allocator.num_slots,
        "kv_slots_used": s.kv.allocator.num_used_slots,
        "kv_slots_peak": c["peak_used_slots"],
        "cache_tokens": cache.total_size,
        "cache_evictable_tokens": cache.evictable_size,
        "cache_protected_tokens": cache.protected_size,
        "cache_wanted_tokens": cache.wanted_size,
        "cache_nodes": cache.num_nodes,
        "schedule_rematches_total": s.policy.num_rematches,
        "new_token_ratio": s.new_token_ratio,
        "jump_forward_tokens_total": c["jump_forward_tokens"],
        **s.lookahead.programs.stats(),
        **s.grammar.stats(),
        **s.prompt_logits.stats(),
        **s.drafter.stats(),  # zeros when speculation is off
        **s.kv.tiers.stats(),
    }
