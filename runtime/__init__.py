"""The flowlang engine. Imports nothing heavy here: `runtime.protocol` must stay torch-free."""
