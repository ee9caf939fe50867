"""Ready-made flowlang programs (the shared workloads W1-W6) and the `flowlang demo` command."""
