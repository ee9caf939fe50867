"""flowlang: structured LLM programs (gen, select, fork, join) compiled to a request graph.

The language arrives with the flowlang issue; this package must stay importable without torch.
"""

__version__ = "0.1.0"
