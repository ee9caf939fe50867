"""Engine stats, HTTP counters and the Batch API's progress as Prometheus text exposition."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

COUNTERS = {
    "prefill_tokens_total",
    "decode_tokens_total",
    "cached_tokens_total",
    "evicted_tokens_total",
    "retractions_total",
    "share_retractions_total",
    "prefill_waits_total",
    "disk_waits_total",
    "admissions_held_total",
    "programs_entered_total",
    "programs_entered_priced_total",
    "program_entries_deferred_total",
    "program_kept_lost_tokens_total",
    "program_returns_recomputed_tokens_total",
    "programs_displaced_total",
    "requests_finished_total",
    "requests_aborted_total",
    "requests_failed_total",
    "forward_passes_total",
    "cuda_graph_replays_total",
    "steps_total",
    "schedule_rematches_total",
    "jump_forward_tokens_total",
    "spec_drafts_total",
    "spec_draft_tokens_total",
    "spec_accepted_tokens_total",
    "kv_demoted_tokens_total",
    "kv_loaded_host_tokens_total",
    "kv_loaded_disk_tokens_total",
    "kv_prefetched_tokens_total",
    "kv_load_seconds_total",
    "kv_prefetch_seconds_total",
    "kv_disk_bad_files_total",
    "kv_disk_writes_total",
    "kv_disk_write_errors_total",
    "kv_disk_writes_inline_total",
    "kv_tier_errors_total",
}


def prometheus_text(
    stats: dict[str, float],
    http_requests: Counter,
    http_errors: Counter,
    num_pins: int,
    num_expired_pins: int,
) -> str:
    lines = []
    for name, value in sorted(stats.items()):
        if not isinstance(value, int | float):
            lines.append(f'flowlang_{name}_info{{value="{value}"}} 1')
            continue
        kind = "counter" if name in COUNTERS else "gauge"
        lines += [f"# TYPE flowlang_{name} {kind}", f"flowlang_{name} {float(value)}"]
    lines += ["# TYPE flowlang_http_requests_total counter"]
    lines += [
        f'flowlang_http_requests_total{{path="{path}"}} {count}'
        for path, count in sorted(http_requests.items())
    ]
    lines += ["# TYPE flowlang_http_errors_total counter"]
    lines += [
        f'flowlang_http_errors_total{{status="{status}"}} {count}'
        for status, count in sorted(http_errors.items())
    ]
    lines += [
        "# TYPE flowlang_http_pins gauge",
        f"flowlang_http_pins {num_pins}",
        "# TYPE flowlang_http_pins_expired_total counter",
        f"flowlang_http_pins_expired_total {num_expired_pins}",
    ]
    return "\n".join(lines) + "\n"


BATCH_STATUSES = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
)


def batch_text(lines: Mapping[str, float], statuses: Counter) -> str:
    """The Batch API's gauges: lines of the running batches by state (summed), the prefill
    the engine saved since the earliest of them began, and stored batches by status."""
    out = ["# TYPE flowlang_batch_lines gauge"]
    for state in ("total", "completed", "failed", "running", "skipped"):
        out.append(f'flowlang_batch_lines{{state="{state}"}} {float(lines[f"lines_{state}"])}')
    out += [
        "# TYPE flowlang_batch_prefill_saved_tokens gauge",
        f"flowlang_batch_prefill_saved_tokens {float(lines['prefill_saved_tokens'])}",
        "# TYPE flowlang_batches gauge",
    ]
    out += [f'flowlang_batches{{status="{s}"}} {statuses.get(s, 0)}' for s in BATCH_STATUSES]
    return "\n".join(out) + "\n"
