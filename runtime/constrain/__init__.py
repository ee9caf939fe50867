"""What the model may say next, and how its output is read back: grammar compile, probe and
check, masks and jump-forward (grammar.py, torch); the queue compiles wait on (compile_queue.py,
torch-free); tool-call and reasoning formats with their parsers (tool_calls.py, reasoning.py,
tool_prompt.py, format_names.py: torch-free, the language uses them).

Imports nothing here, so the torch-free modules stay importable without torch."""
