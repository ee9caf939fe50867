"""Admission, batching and retraction on the radix cache."""
