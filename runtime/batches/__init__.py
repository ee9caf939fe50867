"""Batch files in the OpenAI Batch API's format: input lines read and checked (lines.py), results
appended durably and read back on a rerun (results_file.py), the lines run as one batch through
routes with their shared prefixes pinned once (runner.py), progress an operator reads
(progress.py), the OpenAI routes as line routes (openai_lines.py). Torch-free; runtime/server
serves it as /v1/files and /v1/batches, flowlang's `batch` command runs it offline."""
