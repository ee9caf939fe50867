"""Model runner: architectures, weights, attention backends, sampling."""
