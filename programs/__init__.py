"""Ready-made flowlang programs (the shared workloads W1-W6)."""
